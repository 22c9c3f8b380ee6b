"""`attncc check` and `kernel.check`: lengths, given and invented inputs, progress, and the
warning about params the checked lengths never exercise.

The kernels run under the Triton interpreter (tests/conftest.py); two end-to-end runs at
small shapes, the rest on the command's helpers.
"""
import argparse
from pathlib import Path

import pytest
import torch

import attncc
from attncc.arguments import Problem
from attncc.errors import AttnccError, CallError
from attncc.semantics import samples, unexercised
from attncc.tools import check_command
from attncc.tools.cli import main

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


# ------------------------------------------------------------------ lengths
def _lengths(len=None, len_q=None, len_k=None):
    return check_command.check_lengths(argparse.Namespace(len=len, len_q=len_q, len_k=len_k),
                                       on_gpu=False)


def test_lengths_pair_in_order_and_a_single_value_pairs_with_each():
    assert _lengths(len=[5, 9]) == [(5, 5), (9, 9)]
    assert _lengths(len_q=[1, 300], len_k=[45, 17]) == [(1, 45), (300, 17)]
    assert _lengths(len_q=[20], len_k=[45, 3]) == [(20, 45), (20, 3)]
    assert _lengths(len_q=[7, 8], len_k=[1]) == [(7, 1), (8, 1)]
    assert any(lq != lk for lq, lk in _lengths())  # the defaults include a non-square shape


@pytest.mark.parametrize("kw,says", [
    (dict(len=[5], len_q=[3], len_k=[4]), "either it or --len-q"),
    (dict(len_q=[3]), "--len-q needs --len-k"),
    (dict(len_k=[3]), "--len-k needs --len-q"),
    (dict(len_q=[1, 2], len_k=[1, 2, 3]), "pair in order"),
])
def test_lengths_refuse_what_cannot_pair(kw, says):
    with pytest.raises(AttnccError, match=says):
        _lengths(**kw)


# ------------------------------------------------------------------ given inputs
DOCUMENT = attncc.load(EXAMPLES / "document.attn")


def _saved(tmp_path, obj):
    path = tmp_path / "inputs.pt"
    torch.save(obj, path)
    return str(path)


@pytest.mark.parametrize("obj,says", [
    ([torch.zeros(3)], "holds a list, not a dict"),
    ({"doc_q": torch.zeros(3, dtype=torch.int32)}, "missing 'doc_k'"),
    ({"doc_q": torch.zeros(3), "doc_k": torch.zeros(3), "dco_k": torch.zeros(3)},
     "'dco_k' is not an input of 'document', which declares doc_q, doc_k"),
    ({"doc_q": torch.zeros(3), "doc_k": 3}, "'doc_k' is an int, not a tensor"),
])
def test_inputs_file_names_what_is_wrong(tmp_path, obj, says):
    with pytest.raises(AttnccError, match=says):
        check_command.load_inputs(_saved(tmp_path, obj), DOCUMENT)


def test_inputs_file_that_is_missing_or_not_torch(tmp_path):
    with pytest.raises(AttnccError, match="no such file"):
        check_command.load_inputs(str(tmp_path / "nope.pt"), DOCUMENT)
    (tmp_path / "text.pt").write_text("not a tensor file")
    with pytest.raises(AttnccError, match="cannot read it as a dict of tensors"):
        check_command.load_inputs(str(tmp_path / "text.pt"), DOCUMENT)
    with pytest.raises(AttnccError, match="declares no inputs"):
        check_command.load_inputs(str(tmp_path / "text.pt"), attncc.load(EXAMPLES / "causal.attn"))


def test_inputs_that_do_not_fit_a_checked_shape_are_refused_before_anything_runs():
    given = {"doc_q": torch.zeros(20, dtype=torch.int32), "doc_k": torch.zeros(45, dtype=torch.int32)}
    check_command.check_inputs_fit(DOCUMENT, given, "f.pt", Problem(2, 3, 3, 20, 45, 16, 16))
    with pytest.raises(AttnccError, match=r"len_q 37, len_k 45: input 'doc_q' has shape \(20,\)"):
        check_command.check_inputs_fit(DOCUMENT, given, "f.pt", Problem(2, 3, 3, 37, 45, 16, 16))
    wrong_dtype = dict(given, doc_k=torch.zeros(45))
    with pytest.raises(AttnccError, match="'doc_k' has dtype torch.float32"):
        check_command.check_inputs_fit(DOCUMENT, wrong_dtype, "f.pt", Problem(2, 3, 3, 20, 45, 16, 16))


# ------------------------------------------------------------------ invented inputs
MIXED = attncc.parse("""attention mixed {
    block 16
    input doc_q: i32[q]
    input doc_k: i32[k]
    input kind: i32[h, h]
    input bias: f32[h]
    input on: bool[qb, kb]
    mask  doc_q[q] == doc_k[k] and kind[h, h] >= 0
    layout on[qb, kb]
    score s + bias[h]
}""")


def test_invented_inputs_are_described_as_they_are_made():
    p = Problem(1, 3, 3, 200, 150, 16, 16)
    made = samples.sample_inputs(MIXED, p, seed=5)
    said = samples.describe_invented(MIXED)
    assert said == ["doc_q, doc_k: sorted random document ids, one numbering of positions",
                    "kind: random ints in [0, 8)", "bias: standard normal",
                    f"on: true with probability {samples.BOOL_DENSITY}"]
    # ... and each description holds of what sample_inputs made.
    assert (made["doc_q"].diff() >= 0).all() and torch.equal(made["doc_k"][:150], made["doc_q"][:150])
    assert made["kind"].min() >= 0 and made["kind"].max() < 8 and made["kind"].unique().numel() > 1
    assert made["bias"].dtype == torch.float32 and made["bias"].std() > 0
    assert made["on"].dtype == torch.bool and 0 < made["on"].float().mean() < 1


# ------------------------------------------------------------------ params never exercised
def _window(window: int):
    return attncc.parse(f"attention w {{ param window: int = {window}\n mask q >= k and q - k < window }}")


def _checked(variant, *shapes, heads=(3, 3)):
    problems = [Problem(2, heads[0], heads[1], lq, lk, 16, 16) for lq, lk in shapes]
    return [(p, samples.sample_inputs(variant, p)) for p in problems]


def test_a_window_longer_than_the_lengths_checked_is_named_with_a_length_where_it_matters():
    warnings = unexercised.unexercised_params(_window(1024), _checked(_window(1024), (37, 37), (20, 45)))
    assert len(warnings) == 1 and "param 'window' = 1024 never matters" in warnings[0]
    assert "window = 1023 or 1025" in warnings[0]
    at = int(warnings[0].split("it matters at length ")[1].split(" ")[0])
    # Independently: the plain causal window formula at that length differs between the
    # param's value and a neighbour, and one length shorter it does not.
    def differs(n):
        q, k = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
        return any(not torch.equal((q >= k) & (q - k < 1024), (q >= k) & (q - k < w))
                   for w in (1023, 1025))
    assert differs(at) and not differs(at - 1)


@pytest.mark.parametrize("spec,shapes", [
    ("attention w { param window: int = 16\n mask q >= k and q - k < window }", [(37, 37)]),
    # exercised at one of the shapes only: by the keys past the queries of 2x40
    ("attention w { param window: int = 30\n mask k - q < window }", [(5, 5), (2, 40)]),
    ("attention c { param cap: float = 50.0\n score cap * tanh(s / cap) }", [(3, 4)]),
    ("attention b { param on: bool = true\n mask on or q >= k }", [(9, 9)]),
    ("attention s { param t: float = 2.0\n scale t / sqrt(dim) }", [(1, 1)]),
])
def test_params_that_the_checked_lengths_exercise_give_no_warning(spec, shapes):
    variant = attncc.parse(spec)
    assert unexercised.unexercised_params(variant, _checked(variant, *shapes)) == []


def test_a_param_that_nothing_reads_is_reported_as_never_mattering():
    variant = attncc.parse("attention u { param unused: int = 3\n mask q >= k }")
    [warning] = unexercised.unexercised_params(variant, _checked(variant, (10, 10)))
    assert "param 'unused' = 3 never matters" in warning and "at no length up to" in warning


def test_a_nan_score_is_compared_as_nan_not_skipped():
    # s / (q - k + off) is NaN/inf on the diagonal; whether it is NaN there depends on off.
    variant = attncc.parse("attention n { param off: int = 0\n score s / (q - k + off) }")
    assert unexercised.unexercised_params(variant, _checked(variant, (4, 4))) == []
    p = Problem(1, 1, 1, 4, 4, 16, 16)
    own = unexercised.behaviour(variant, p, {})
    assert torch.isnan(own[1]).any() or torch.isinf(own[1]).any()
    assert unexercised._same(own, unexercised.behaviour(variant, p, {}))


# ------------------------------------------------------------------ end to end
@pytest.mark.skipif(DEVICE == "cuda", reason="the command's CPU path, under the interpreter: "
                    "float32 and its progress lines")
def test_check_command_with_given_inputs_and_uneven_lengths_reports_progress(tmp_path, capsys,
                                                                             monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gen = torch.Generator().manual_seed(0)
    docs = torch.sort(torch.randint(0, 3, (45,), generator=gen)).values.to(torch.int32)
    path = _saved(tmp_path, {"doc_q": docs[:19].clone(), "doc_k": docs})
    assert main(["check", str(EXAMPLES / "document.attn"), "--len-q", "19", "--len-k", "45",
                 "--dim", "16", "--heads", "1", "--inputs", path]) == 0
    out, err = capsys.readouterr()
    assert f"inputs: doc_q, doc_k from {path}" in out and "invented" not in out
    assert "len_q 19, len_k 45" in out and "OK: every tensor within tolerance" in out
    assert "[1/1] batch 2, heads 1/1, len_q 19, len_k 45, dim 16, float32" in err
    assert "[1/1] len_q 19, len_k 45 done in" in err and "kernel" in err.splitlines()[-1]
    # The same file at a length it does not fit: refused at once, exit 2, naming the input.
    assert main(["check", str(EXAMPLES / "document.attn"), "--len", "19", "--dim", "16",
                 "--inputs", path]) == 2
    assert "input 'doc_k' has shape (45,)" in capsys.readouterr().err


def test_kernel_check_on_your_own_inputs(recwarn):
    variant = attncc.parse("attention biased { param window: int = 500\n input bias: f32[h]\n"
                           " mask q >= k and q - k < window\n score s + bias[h] }")
    kernel = attncc.compile(variant)
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, n, 16, generator=gen).to(DEVICE) for n in (13, 21, 21))
    bias = (torch.randn(2, generator=gen) * 4).to(DEVICE)
    report = kernel.check(q, k, v, bias=bias)
    assert report.ok and report.failed == []
    assert [r[0] for r in report.rows] == ["out", "lse", "dq", "dk", "dv"]
    assert "param 'window' = 500 never matters" in report.warnings[0]
    assert any("param 'window'" in str(w.message) for w in recwarn)
    assert "OK: every tensor within tolerance" in str(report)
    with pytest.raises(CallError, match="input 'bias' has shape"):
        kernel.check(q, k, v, bias=torch.randn(4, device=DEVICE))
    with pytest.raises(CallError, match=r"dout must be a tensor shaped like the output \(1, 2, 13, 16\)"):
        kernel.check(q, k, v, dout=torch.randn(1, 2, 13, 8, device=DEVICE), bias=bias)


def test_check_command_takes_vs_head_dim(capsys, monkeypatch):
    """`attncc check` drew v at q's head dim: a variant whose v is narrower (differential
    attention's is wider) could not be checked at its own shapes."""
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert main(["check", str(EXAMPLES / "causal.attn"), "--len", "21", "--dim", "32",
                 "--dim-v", "16", "--heads", "2", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "dim 32, dim_v 16" in out and "OK: every tensor within tolerance" in out
    assert main(["check", str(EXAMPLES / "causal.attn"), "--dim-v", "0"]) == 2
    assert "--dim-v 0: the kernels take v head dims 16 to 512" in capsys.readouterr().err


def test_kernel_check_where_v_has_its_own_head_dim():
    """dO was drawn in q's shape, so check() crashed in the backward wherever v's head dim
    differs from q's, and refused a dout shaped like the output."""
    kernel = attncc.compile("attention narrow_v { mask q >= k }")
    gen = torch.Generator().manual_seed(4)
    q, k = (torch.randn(1, 3, n, 32, generator=gen).to(DEVICE) for n in (37, 41))
    v = torch.randn(1, 3, 41, 16, generator=gen).to(DEVICE)
    assert kernel.check(q, k, v).ok
    assert kernel.check(q, k, v, dout=torch.randn(1, 3, 37, 16, device=DEVICE)).ok


def test_kernel_check_takes_the_calls_offsets_and_layout():
    """A chunk at q_offset 8 of a windowed causal mask, in (batch, seq, heads, dim): check()
    refused q_offset= and layout= with "did you mean" the same name. The kernel and both
    references must read the same positions, or the window's edge differs."""
    kernel = attncc.compile("attention w { mask q >= k and q - k < 6 }")
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, n, 2, 16, generator=gen).to(DEVICE) for n in (13, 21, 21))
    report = kernel.check(q, k, v, q_offset=8, layout="bshd")
    assert report.ok, report
    assert [r[0] for r in report.rows] == ["out", "lse", "dq", "dk", "dv"]
    with pytest.raises(CallError, match=r"return_lse= is an option of the kernel call, which "
                                        r"this call does not take"):
        kernel.check(q, k, v, return_lse=True, layout="bshd")


def test_a_shape_too_large_to_evaluate_densely_gives_no_warning_rather_than_stalling():
    variant = _window(100_000)
    big = Problem(2, 8, 8, 2048, 4096, 16, 16)  # 8 x 2048 x 4096 pairs: over the cap
    assert 8 * 2048 * 4096 > unexercised.MAX_SEARCH_ELEMENTS
    assert unexercised.unexercised_params(variant, [(big, {})]) == []
    assert unexercised.unexercised_params(variant, _checked(variant, (30, 30), heads=(1, 1))) != []


def test_each_unexercised_param_gets_its_own_warning():
    variant = attncc.parse("attention two { param left: int = 40\n param right: int = 3\n"
                           " param far: int = 90\n mask q - k < left and k - q < far and q >= right }")
    warnings = unexercised.unexercised_params(variant, _checked(variant, (20, 20), heads=(1, 1)))
    assert [w.split("'")[1] for w in warnings] == ["left", "far"]  # right = 3 shows at 20
    # Independently: at the length named, the formula with the param one step away
    # masks differently (q - k = 39 first occurs at 40; k - q = 89 with q >= 3 at 93).
    def mask(n, left=40, far=90):
        q, k = torch.arange(n).view(-1, 1), torch.arange(n).view(1, -1)
        return (q - k < left) & (k - q < far) & (q >= 3)
    left_at, far_at = (int(w.split("it matters at length ")[1].split(" ")[0]) for w in warnings)
    assert left_at == 40 and not torch.equal(mask(40), mask(40, left=39))
    assert far_at >= 93 and not torch.equal(mask(far_at), mask(far_at, far=89))


def test_a_param_past_the_searched_lengths_is_not_called_unused():
    """chunked_local's chunk = 8192 matters from length 8193, past the search's longest
    length: the warning asked "(is it used?)" of a param the mask reads."""
    variant = attncc.parse("attention c { param chunk: int = 8192\n mask q // chunk == k // chunk }")
    [warning] = unexercised.unexercised_params(variant, _checked(variant, (30, 30)))
    assert "is it used" not in warning and "--len 8193" in warning
