"""Located error messages: golden files, the `attncc show` command, and hostile input.

Each tests/golden/errors/NAME.attn holds one mistake and NAME.expected the exact text of
the SpecError it must raise (file:line:col, the sentence, the source line, the caret).
After a deliberate change to a message, regenerate the expected files and review the diff:

    python tests/test_errors.py --update

tests/hostile/*.attn and the generated cases below are inputs no one writes on purpose
(binary data, megabyte files, 10000 nested parentheses): each must give a SpecError —
never another exception, never a hang.
"""
import subprocess
import sys
import time
from functools import reduce
from pathlib import Path

import pytest

import attncc
from attncc.frontend import checker, parser
from attncc.tools.cli import main as cli_main
from attncc.frontend.parser import parse_bytes

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "golden" / "errors"
HOSTILE = HERE / "hostile"
GOLDEN_CASES = sorted(GOLDEN.glob("*.attn"))
HOSTILE_FILES = sorted(HOSTILE.glob("*.attn"))


def message_for(path: Path) -> str:
    """The error text for a golden case, located by the file's name alone."""
    try:
        parse_bytes(path.read_bytes(), path=path.name)
    except attncc.SpecError as err:
        return str(err) + "\n"
    raise AssertionError(f"{path.name} parsed without an error")


# ---------------------------------------------------------------------------- golden
@pytest.mark.parametrize("case", GOLDEN_CASES, ids=lambda p: p.stem)
def test_golden_error_message(case):
    expected = case.with_suffix(".expected")
    assert expected.exists(), f"run `python tests/test_errors.py --update` to create {expected.name}"
    assert message_for(case) == expected.read_text(encoding="utf-8")


def test_every_expected_file_has_its_spec():
    orphans = {p.stem for p in GOLDEN.glob("*.expected")} - {p.stem for p in GOLDEN_CASES}
    assert not orphans


def test_golden_corpus_covers_the_promised_mistakes():
    names = {p.stem for p in GOLDEN_CASES}
    promised = {
        "missing_brace", "stray_token", "double_ampersand", "bad_number", "unknown_name",
        "mask_not_boolean", "score_boolean", "wrong_index_count", "float_index",
        "param_without_value", "param_wrong_type", "duplicate_mask", "duplicate_name",
        "keyword_as_name", "heads_not_multiple", "tile_index_in_mask", "query_in_layout",
        "score_in_mask", "layout_without_block", "block_not_power_of_two", "dropout_one",
        "empty_file", "comment_only", "non_utf8", "unknown_function", "function_arity",
        "calling_a_tensor", "unknown_dtype", "unknown_axis",
    }
    assert promised <= names, sorted(promised - names)


@pytest.mark.parametrize("case", GOLDEN_CASES, ids=lambda p: p.stem)
def test_messages_speak_the_language(case):
    text = message_for(case)
    # Never lark's terminal names, never Python's internals.
    for leak in ("Token(", "LPAR", "RBRACE", "COMP_OP", "$END", "<END-OF-FILE>", "Traceback",
                 "lark", "__"):
        assert leak not in text, (leak, text)
    head = text.splitlines()[0]
    assert head.startswith(f"{case.name}:") and ": error: " in head


def test_caret_sits_under_the_reported_column():
    for case in GOLDEN_CASES:
        lines = message_for(case).splitlines()
        if len(lines) < 3:
            continue  # errors about the whole file have no line to point at
        column = int(lines[0].split(":")[2])
        caret = lines[2]
        assert caret.index("^") == 4 + column - 1, case.name


# ------------------------------------------------------------------------ the command
def test_show_bad_spec_prints_the_golden_message_and_exits_2(monkeypatch, capsys):
    monkeypatch.chdir(GOLDEN)  # so the command names the file as the golden text does
    for case in GOLDEN_CASES:
        assert cli_main(["show", case.name]) == 2, case.name
        out, err = capsys.readouterr()
        assert out == ""
        assert err == case.with_suffix(".expected").read_text(encoding="utf-8"), case.name


def test_show_in_a_subprocess_exits_2_without_a_traceback():
    case = GOLDEN / "unknown_name.attn"
    r = subprocess.run([sys.executable, "-m", "attncc", "show", case.name],
                       capture_output=True, text=True, cwd=GOLDEN, timeout=60)
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr == case.with_suffix(".expected").read_text(encoding="utf-8")
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("target", ["missing.attn", "."])
def test_show_unreadable_path_exits_2(target, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli_main(["show", target]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and ("no such file" in err or "is a directory" in err)


# --------------------------------------------------------------------------- hostile
def _generated() -> dict:
    """Hostile specs too big to keep as files: name -> bytes."""
    spec = lambda body: b"attention a {\n    " + body + b"\n}\n"
    return {
        "parens_10000_deep": spec(b"mask " + b"(" * 10000 + b"q >= k" + b")" * 10000),
        "brackets_3000_deep": spec(b"score s + t[" + b"t[" * 3000 + b"k" + b"]" * 3001),
        "calls_5000_deep": spec(b"score " + b"abs(" * 5000 + b"s" + b")" * 5000),
        "where_3000_deep": spec(b"score " + b"where(q > k, " * 3000 + b"s" + b", s)" * 3000),
        "minus_10000_deep": spec(b"score " + b"-" * 10000 + b"s"),
        "not_10000_deep": spec(b"mask " + b"not " * 10000 + b"q >= k"),
        "sum_of_15000_terms": spec(b"score s" + b" + s" * 15000),
        "and_of_5000_terms": spec(b"mask q >= k" + b" and q >= k" * 5000),
        "chain_of_15000_comparisons": spec(b"mask q" + b" < q" * 15000),
        "two_megabytes": spec(b"mask q >= k") + b"# " + b"x" * (2 << 20),
        "two_megabytes_of_code": spec(b"mask q >= k" + b" and q >= k" * 200000),
        "one_byte_over_the_limit": spec(b"mask q >= k").ljust(parser.MAX_SOURCE_BYTES + 1, b"#"),
        "line_of_60000_spaces": spec(b"mask q >= k" + b" " * 60000 + b")"),
        "name_of_60000_letters": spec(b"mask q >= " + b"x" * 60000),
        "integer_of_5000_digits": spec(b"mask q - k < " + b"9" * 5000),
        "float_of_400_digits": spec(b"score s * 1" + b"0" * 400 + b".0"),
        "dropout_of_400_digits": b"attention a { dropout 1" + b"0" * 400 + b".0 }",
        "3000_params_then_a_typo": spec(b"".join(b"param p%d: int = 1\n" % i for i in range(3000))
                                        + b"mask q >= zz"),
        "10000_axes": spec(b"input t: f32[" + b"h, " * 10000 + b"h]\n    score s + t[h]"),
        "20000_arguments": spec(b"score max(" + b"s, " * 20000 + b"s)"),
        "32000_arguments_unspaced": spec(b"score max(" + b"s," * 32000 + b"s)"),
        # Under the token limit, so the check each one aims at (depth, arity, axes, an
        # unknown name among many) refuses it, not the token count.
        "sum_of_1500_terms": spec(b"score s" + b" + s" * 1500),
        "and_of_500_terms": spec(b"mask q >= k" + b" and q >= k" * 500),
        "chain_of_1500_comparisons": spec(b"mask q" + b" < q" * 1500),
        "minus_3000_deep": spec(b"score " + b"-" * 3000 + b"s"),
        "not_3000_deep": spec(b"mask " + b"not " * 3000 + b"q >= k"),
        "600_params_then_a_typo": spec(b"".join(b"param p%d: int = 1\n" % i for i in range(600))
                                       + b"mask q >= zz"),
        "1500_axes": spec(b"input t: f32[" + b"h, " * 1500 + b"h]\n    score s + t[h]"),
        "1500_arguments": spec(b"score max(" + b"s, " * 1500 + b"s)"),
        "30000_stray_tokens": spec(b"mask " + b"q " * 30000),
        "nul_bytes_only": b"\x00" * (1 << 15),
    }


GENERATED = _generated()
HOSTILE_CASES = [(p.stem, p.read_bytes()) for p in HOSTILE_FILES] + sorted(GENERATED.items())


def test_hostile_corpus_is_large_enough():
    assert len(HOSTILE_FILES) >= 30
    assert len(GOLDEN_CASES) + len(HOSTILE_CASES) >= 40


@pytest.mark.parametrize("name, data", HOSTILE_CASES, ids=[n for n, _ in HOSTILE_CASES])
def test_hostile_spec_gives_a_spec_error_quickly(name, data):
    start = time.perf_counter()
    with pytest.raises(attncc.SpecError) as info:
        parse_bytes(data, path=f"{name}.attn")
    elapsed = time.perf_counter() - start
    assert elapsed < 5, f"{name} took {elapsed:.1f} s"
    text = str(info.value)
    assert text.startswith(f"{name}.attn") and "error: " in text
    # Hostile text must not flood the terminal or drive it: a short, printable message.
    assert len(text) < 1000
    assert all(c.isprintable() or c == "\n" for c in text)


@pytest.mark.parametrize("name", ["nul_bytes", "binary_garbage", "terminal_escape"])
def test_hostile_file_through_the_command(name, monkeypatch, capsys):
    monkeypatch.chdir(HOSTILE)
    assert cli_main(["show", f"{name}.attn"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"{name}.attn:") and "\x1b" not in err


@pytest.mark.parametrize("name, message", [
    # A flat chain nests nothing the user wrote: it is named as a chain, with its length.
    ("sum_of_1500_terms", r"an operator chain longer than 128 levels allow: \d+ `\+` or `-` in a row"),
    ("and_of_500_terms", r"an operator chain longer than 128 levels allow: \d+ `and` in a row"),
    ("chain_of_1500_comparisons", r"comparison chain is longer than 128 comparisons"),
    ("minus_3000_deep", r"an operator chain longer than 128 levels allow: 3000 `-` in a row"),
    ("not_3000_deep", r"an operator chain longer than 128 levels allow: 3000 `not` in a row"),
    ("600_params_then_a_typo", "unknown name 'zz'"),
    ("1500_axes", "has 1501 axes"), ("1500_arguments", "not 1501"),
    ("20000_arguments", "tokens"), ("32000_arguments_unspaced", "tokens"),
])
def test_hostile_spec_is_refused_by_the_check_it_aims_at(name, message):
    with pytest.raises(attncc.SpecError, match=message):
        parse_bytes(GENERATED[name], path=f"{name}.attn")


@pytest.mark.parametrize("expr, message", [
    (" * ".join(["s"] * 150), r"operator chain longer than 128 levels allow: 149 `\*`, `/`, `//` or `%`"),
    ("tanh(" * 127 + "s" + ")" * 127, r"nested more than 128 levels deep"),
    ("tanh(" * 70 + " + ".join(["s"] * 70) + ")" * 70, r"nested more than 128 levels deep"),
], ids=["product_chain", "nested_calls", "nested_calls_around_a_sum"])
def test_a_long_chain_is_named_a_chain_and_deep_nesting_nesting(expr, message):
    with pytest.raises(attncc.SpecError, match=message):
        attncc.parse(f"attention a {{ score {expr} }}")


def test_a_long_chain_from_the_decorator_is_named_a_chain():
    score = eval("lambda s: " + " - ".join(["s"] * 200))
    with pytest.raises(attncc.SpecError, match=r"operator chain longer than 128 levels allow: "
                                               r"199 `\+` or `-` in a row"):
        attncc.variant(name="long", inputs={})(type("C", (), {"score": staticmethod(score)}))


def test_spec_at_the_token_limit_parses_and_one_more_token_is_refused_there():
    # `attention a {`, `mask q > k` and `}` are 8 tokens, each `param pN: int = 1` 6,
    # each ` and true` 2; comments do not count.
    params = (parser.MAX_TOKENS - 8) // 6
    padding = parser.MAX_TOKENS - 8 - 6 * params
    body = b"".join(b"    param p%d: int = 1\n" % i for i in range(params))
    comment = b"    # " + b"x " * 5000 + b"\n"
    at_limit = (b"attention a {\n" + comment + body
                + b"    mask q > k" + b" and true" * (padding // 2) + b"\n}\n")
    assert padding % 2 == 0 and len(parse_bytes(at_limit).params) == params
    with pytest.raises(attncc.SpecError, match=f"more than {parser.MAX_TOKENS} tokens") as info:
        parse_bytes(at_limit.replace(b"\n}", b" and true\n}"))
    assert f":{params + 3}:" in str(info.value)  # the mask's line, after the comment


def test_endless_file_is_refused_without_reading_it_all():
    with pytest.raises(attncc.SpecError, match="larger than"):
        attncc.parse_file("/dev/zero")


def test_decorator_cannot_build_an_endlessly_deep_expression():
    # Python loops can build IR as deep as they like; the checker refuses it before
    # any recursive pass would overflow the stack.
    deep = lambda q, k: reduce(lambda acc, _: acc & (q >= k), range(5000), q >= k)
    with pytest.raises(attncc.SpecError, match=f"an operator chain longer than {checker.MAX_DEPTH} "
                                               "levels allow: 5000 `and` in a row"):
        attncc.variant(deep, name="deep")


@pytest.mark.parametrize("name", ["", "my variant", "../escape", "x-y", "ünï"])
def test_decorator_names_must_be_names(name):
    with pytest.raises(attncc.SpecError, match="is not a name"):
        attncc.variant(lambda q, k: q >= k, name=name)
    with pytest.raises(attncc.SpecError, match="is not a name"):
        attncc.variant(lambda q, k: q >= k, name="ok", params={name: 1})


def _update():
    for case in GOLDEN_CASES:
        case.with_suffix(".expected").write_text(message_for(case), encoding="utf-8")
    print(f"wrote {len(GOLDEN_CASES)} expected messages in {GOLDEN}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--update"]:
        _update()
    else:
        sys.exit("usage: python tests/test_errors.py --update   (regenerates golden/errors/*.expected)")


def test_a_kernel_fault_while_tuning_stops_the_tuner_and_names_the_way_out(monkeypatch):
    # An illegal memory access leaves the CUDA context unusable: every later candidate
    # would fail too, and the tuner used to skip them all and then say only that no tile
    # config could run. Now the first such error stops it, named; a candidate that fails
    # otherwise (out of resources, a compile failure) is still skipped.
    import triton
    from attncc.errors import AttnccError, KernelFaultError
    from attncc.runtime import tuning
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: fn() or 1.0)
    ran = []

    def run(candidate):
        ran.append(candidate)
        if candidate == "b":
            raise RuntimeError("out of resource: shared memory, Required: 300000")
        if candidate == "c":
            raise RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered")

    timings = tuning.time_candidates("v", "dq-k", ["a", "b"], run, str)
    assert [c for _, c in timings] == ["a"]  # b skipped
    with pytest.raises(KernelFaultError) as caught:
        tuning.time_candidates("v", "dq-k", ["a", "b", "c", "d"], run, str)
    text = str(caught.value)
    assert isinstance(caught.value, AttnccError)
    assert "illegal memory access" in text and "tuning v (dq-k), c (candidate 3 of 4" in text
    assert "CUDA_LAUNCH_BLOCKING=1" in text and "ATTNCC_CONFIG" in text
    assert ran[-1] == "c"  # d was never tried
