"""kernel.decode's launch plans (attncc/runtime/decoding.py) and the direct relaunch of a
compiled Triton kernel (attncc/runtime/launch.py).

An eager decode call like an earlier one skips the checks and the config and runs the
earlier call's plan. The tests here hold a plan to its promise both ways: a call it fits
runs on that call's own tensors (new values, new cache lengths, new inputs give the
float64 reference's answer, not the earlier call's), and a call it does not fit (another
shape, dtype, stride, alignment, option, input layout; an int length out of range; a
non-tensor) never runs it: it makes a plan of its own or is refused as before. Under a
tensor mode the call still goes through the decode op, so the mode sees it. `Launch`
is checked against a stand-in JIT kernel: its relaunch passes the compiled kernel
exactly the arguments the JIT passed, and falls back to the JIT under a launch hook.
"""
from __future__ import annotations

import math

import pytest
import torch
import triton

import attncc
from attncc.errors import CallError
from attncc.runtime import decoding, launch
from attncc.semantics.decoding import decode_reference
from attncc.semantics.tolerance import max_abs_error, within_tolerance

CAUSAL = "attention causal { mask q >= k }"
ALIBI = "attention alibi { input slopes: f32[h]  mask q >= k  score s + slopes[h] * (k - q) }"
B, HQ, HKV, CAPACITY, D = 1, 2, 1, 24, 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU: the compiled relaunch


def tensors(seed, *, dtype=torch.float32, n_q=1, batch=B):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, HQ, n_q, D, generator=gen).to(dtype)
    k = torch.randn(batch, HKV, CAPACITY, D, generator=gen).to(dtype)
    v = torch.randn(batch, HKV, CAPACITY, D, generator=gen).to(dtype)
    lens = torch.randint(1, CAPACITY - 2, (batch,), generator=gen).to(torch.int32)
    slopes = torch.rand(HQ, generator=gen) * 0.5
    return tuple(t.to(DEVICE) for t in (q, k, v, lens, slopes))


def assert_matches_reference(variant, out, lse, q, k, v, **call):
    ref = decode_reference(variant, q.double(), k.double(), v.double(), return_lse=True,
                           **{n: (t.double() if torch.is_tensor(t) and t.is_floating_point() else t)
                              for n, t in call.items()})
    eager = decode_reference(variant, q, k, v, return_lse=True, **call)
    for got, r, e in zip((out, lse), ref, eager):
        err = max_abs_error(got, r)
        assert not math.isnan(err) and within_tolerance(err, max_abs_error(e, r), q.dtype, r), err


def test_a_repeated_call_runs_its_plan_on_its_own_tensors():
    kernel = attncc.compile(ALIBI)
    q, k, v, lens, slopes = tensors(0)
    kernel.decode(q, k, v, cache_seqlens=lens, slopes=slopes)
    assert len(kernel._decode_plans) == 1
    made = []
    original = decoding.make_plan
    decoding.make_plan = lambda *a, **kw: made.append(1) or original(*a, **kw)
    try:
        # New values everywhere, the input included: the plan reads this call's tensors.
        q, k, v, lens, slopes = tensors(1)
        out, lse = kernel.decode(q, k, v, cache_seqlens=lens, slopes=slopes, return_lse=True)
    finally:
        decoding.make_plan = original
    assert made == [] and len(kernel._decode_plans) == 1
    assert_matches_reference(kernel.variant, out, lse, q, k, v, cache_seqlens=lens, slopes=slopes)
    # On a GPU the second call relaunched the kernels the first compiled; the interpreter
    # compiles nothing, and its launches stay on the JIT.
    plan = next(iter(kernel._decode_plans.values()))
    cells = []
    for cell in plan.run.__closure__:
        try:
            cells.append(cell.cell_contents)
        except ValueError:  # decode_append's launch, unbound in a plan that appends nothing
            pass
    launches = [c for c in cells if isinstance(c, launch.Launch)]
    # decode_split, and decode_merge where the plan splits the cache (the GPU's untuned
    # config can take the whole cache in one split: the H200 did, run 137).
    assert 1 <= len(launches) <= 2
    assert all((run.compiled is not None) == (DEVICE == "cuda") for run in launches)


def test_a_plan_keeps_no_tensor_of_the_call_it_was_made_from():
    import gc
    import weakref
    kernel = attncc.compile(ALIBI)
    q, k, v, lens, slopes = tensors(11)
    kernel.decode(q, k, v, cache_seqlens=lens, slopes=slopes)
    made_from = [weakref.ref(t) for t in (q, k, v, lens, slopes)]
    del q, k, v, lens, slopes
    gc.collect()
    assert len(kernel._decode_plans) == 1 and all(ref() is None for ref in made_from)


def test_appending_through_a_plan_writes_each_calls_tokens():
    kernel = attncc.compile(CAUSAL)
    q, k, v, lens, _ = tensors(2)
    for step in range(3):  # a generation loop: one token appended per step
        gen = torch.Generator().manual_seed(10 + step)
        k_new, v_new = (torch.randn(B, HKV, 1, D, generator=gen).to(DEVICE) for _ in range(2))
        before_k, before_v = k.clone(), v.clone()
        out, lse = kernel.decode(q, k, v, cache_seqlens=lens, k_new=k_new, v_new=v_new,
                                 return_lse=True)
        assert_matches_reference(kernel.variant, out, lse, q, before_k, before_v,
                                 cache_seqlens=lens, k_new=k_new, v_new=v_new)
        lens = lens + 1
    assert len(kernel._decode_plans) == 1


def _variations():
    """Calls that a plan made for the base call does not fit, each with its change."""
    q, k, v, lens, _ = tensors(3)
    base = dict(q=q, k=k, v=v, cache_seqlens=lens)
    q2, k2, v2, lens2, _ = tensors(4, n_q=2)
    qh, kh, vh, _, _ = tensors(5, dtype=torch.float16)
    qb, kb, vb, lensb, _ = tensors(6, batch=2)
    wide = torch.randn(B, HQ, 1, 2 * D, device=DEVICE)[..., :D]  # strides of a (..., 2D) tensor
    storage = torch.randn(q.numel() + 1, device=DEVICE)
    shifted = storage[1:].view(q.shape)  # 4 bytes off a 16-byte boundary
    return {
        "n_q": dict(base, q=q2),
        "dtype": dict(base, q=qh, k=kh, v=vh),
        "batch": dict(q=qb, k=kb, v=vb, cache_seqlens=lensb),
        "capacity": dict(base, k=k[:, :, :-8], v=v[:, :, :-8]),
        "stride": dict(base, q=wide.copy_(q)),
        "alignment": dict(base, q=shifted.copy_(q)),
        "int length": dict(base, cache_seqlens=int(lens.max())),
        "num_splits": dict(base, num_splits=2),
        "config": dict(base, config=dict(BLOCK_N=16, num_warps=4, num_stages=1, num_splits=4)),
        "rows_before_start": dict(base, rows_before_start=True),
        "append": dict(base, k_new=k2[:, :, :1], v_new=v2[:, :, :1]),
    }


@pytest.mark.parametrize("change", list(_variations()))
def test_a_plan_is_not_used_for_a_call_it_does_not_fit(change):
    kernel = attncc.compile(CAUSAL)
    q, k, v, lens, _ = tensors(3)
    kernel.decode(q, k, v, cache_seqlens=lens)
    call = _variations()[change]
    q, k, v = call.pop("q"), call.pop("k"), call.pop("v")
    before = (k.clone(), v.clone())
    out, lse = kernel.decode(q, k, v, return_lse=True, **call)
    assert len(kernel._decode_plans) == 2, change
    call.pop("num_splits", None), call.pop("config", None), call.pop("rows_before_start", None)
    assert_matches_reference(kernel.variant, out, lse, q, *before, **call)


def test_an_int_length_is_checked_on_every_call():
    kernel = attncc.compile(CAUSAL)
    q, k, v, _, _ = tensors(7)
    kernel.decode(q, k, v, cache_seqlens=5)
    out = kernel.decode(q, k, v, cache_seqlens=CAPACITY)  # the same plan, another length
    assert len(kernel._decode_plans) == 1
    ref = decode_reference(kernel.variant, q.double(), k.double(), v.double(),
                           cache_seqlens=CAPACITY)
    assert max_abs_error(out, ref) < 1e-4  # every key of the cache, not the first call's 5
    for bad in (CAPACITY + 1, -1):
        with pytest.raises(CallError, match="cache_seqlens"):
            kernel.decode(q, k, v, cache_seqlens=bad)


def test_a_strided_length_tensor_is_read_by_row_through_a_plan_too():
    """The checked call made a strided cache_seqlens contiguous, but the plan a repeated
    call ran handed the strided tensor to the kernels: wrong outputs from the second
    step on, and the new keys written at the wrong positions."""
    kernel = attncc.compile(CAUSAL)
    q, k, v, _, _ = tensors(12, batch=3)
    table = torch.tensor([[5, 90], [17, 91], [11, 92]], dtype=torch.int32, device=DEVICE)
    lens = table[:, 0]  # stride 2
    for step in range(3):
        k_new, v_new = (torch.randn(3, HKV, 1, D, device=DEVICE) for _ in range(2))
        before_k, before_v = k.clone(), v.clone()
        out, lse = kernel.decode(q, k, v, cache_seqlens=lens, k_new=k_new, v_new=v_new,
                                 return_lse=True)
        for b, n in enumerate(table[:, 0].tolist()):
            before_k[b, :, n], before_v[b, :, n] = k_new[b, :, 0], v_new[b, :, 0]
        assert torch.equal(k, before_k) and torch.equal(v, before_v), step  # nothing else moved
        assert_matches_reference(kernel.variant, out, lse, q, k, v,
                                 cache_seqlens=table[:, 0].contiguous() + 1)
        table[:, 0] += 1
    assert len(kernel._decode_plans) == 1


def test_a_repeated_call_is_refused_as_the_first_was():
    """The plan's key does not hold return_lse: a `normalize none` variant refused
    return_lse=True on a first call but answered it, with an LSE of -inf, after a plain
    call had made the plan."""
    kernel = attncc.compile("attention n { mask q >= k  weight sigmoid(s)  normalize none }")
    q, k, v, lens, _ = tensors(13)
    kernel.decode(q, k, v, cache_seqlens=lens)
    with pytest.raises(CallError, match="return_lse=True: variant 'n' has `normalize none`"):
        kernel.decode(q, k, v, cache_seqlens=lens, return_lse=True)


def test_an_append_bumps_the_caches_versions_and_an_expanded_cache_is_refused():
    """The kernels write the new tokens behind autograd's back: a backward through an
    earlier call that saved the cache ran on the overwritten keys (q.grad off by 6e3).
    An expanded cache (kv heads sharing memory) took head 1's key over head 0's."""
    kernel = attncc.compile(CAUSAL)
    q, k, v, lens, _ = tensors(14)
    k_new, v_new = (torch.randn(B, HKV, 1, D, device=DEVICE) for _ in range(2))
    qg = q.clone().requires_grad_()
    saved = (qg * 2) @ k.transpose(-1, -2)  # autograd saves k
    versions = k._version, v._version
    kernel.decode(q, k, v, cache_seqlens=lens, k_new=k_new, v_new=v_new)
    assert k._version > versions[0] and v._version > versions[1]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()
    wide = torch.randn(B, 1, CAPACITY, D, device=DEVICE).expand(B, 2, CAPACITY, D)
    with pytest.raises(CallError, match=r"k_cache .* an expanded tensor.*\.contiguous\(\)"):
        kernel.decode(q, wide, wide.clone(), cache_seqlens=lens,
                      k_new=k_new.expand(B, 2, 1, D), v_new=v_new.expand(B, 2, 1, D))


def test_options_equal_as_keys_but_not_as_values_are_told_apart():
    # True == 1 and hash(True) == hash(1): a plan keyed on the bare value would run a
    # num_splits=True call that the checks refuse.
    kernel = attncc.compile(CAUSAL)
    q, k, v, lens, _ = tensors(8)
    kernel.decode(q, k, v, cache_seqlens=lens, num_splits=1)
    with pytest.raises(CallError, match="num_splits"):
        kernel.decode(q, k, v, cache_seqlens=lens, num_splits=True)


def test_a_non_tensor_or_a_new_keyword_goes_through_the_checks():
    kernel = attncc.compile(ALIBI)
    q, k, v, lens, slopes = tensors(9)
    kernel.decode(q, k, v, cache_seqlens=lens, slopes=slopes)
    with pytest.raises(CallError):
        kernel.decode(q, k, v, cache_seqlens=lens, slopes=slopes.tolist())
    with pytest.raises(CallError, match="q_offset"):
        kernel.decode(q, k, v, cache_seqlens=lens, slopes=slopes, q_offset=1)
    with pytest.raises(CallError, match="return_lse"):
        kernel.decode(q, k, v, cache_seqlens=lens, slopes=slopes, return_lse=1)
    with pytest.raises(CallError):  # a wrongly shaped input: another key, checked
        kernel.decode(q, k, v, cache_seqlens=lens, slopes=slopes[:1])


def test_a_dispatch_mode_sees_the_decode_op():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Names(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    kernel = attncc.compile(CAUSAL)
    q, k, v, lens, _ = tensors(10)
    first = kernel.decode(q, k, v, cache_seqlens=lens)  # makes the plan
    with Names() as mode:
        again = kernel.decode(q, k, v, cache_seqlens=lens)
    assert any("_decode" in name and "attncc" in name for name in mode.seen), mode.seen
    assert torch.equal(first, again)


# ------------------------------------------------------------------------- Launch
class _Compiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self, calls):
        self.calls = calls

    def run(self, *args):
        self.calls.append(("run", args))


class _Jit:
    """A stand-in @triton.jit kernel with parameters a, b (tensors or ints) and C, D
    (constexprs passed as options); the JIT returns its compiled kernel, or None as the
    interpreter does."""
    arg_names = ["a", "b", "C", "D"]

    def __init__(self, compiled=True):
        self.calls = []
        self.compiled = _Compiled(self.calls) if compiled else None

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.calls.append(("jit", grid, args, options))
            return self.compiled
        return launch


@pytest.fixture
def device_stub(monkeypatch):
    monkeypatch.setattr(launch, "current_device", lambda: 0)
    monkeypatch.setattr(launch, "current_stream", lambda device: 1234)


def test_launch_relaunches_the_compiled_kernel_with_what_the_jit_bound(device_stub):
    jit = _Jit()
    run = launch.Launch(jit, (3, 2), dict(C=16, D=True, num_warps=4))
    run("x", 7)
    run("y", 7)
    assert jit.calls[0] == ("jit", (3, 2, 1), ("x", 7), dict(C=16, D=True, num_warps=4))
    # What JITFunction.run passes: grid, stream, function, metadata, launch metadata and
    # the two hooks, then every parameter in order (constexprs included).
    assert jit.calls[1] == ("run", (3, 2, 1, 1234, "function", "metadata", None, None, None,
                                    "y", 7, 16, True))


def test_launch_stays_on_the_jit_under_the_interpreter_or_a_launch_hook(device_stub):
    jit = _Jit(compiled=False)
    run = launch.Launch(jit, (1,), dict(C=1, D=False))
    run(1, 2), run(1, 2)
    assert [c[0] for c in jit.calls] == ["jit", "jit"]
    jit = _Jit()
    run = launch.Launch(jit, (1,), dict(C=1, D=False))
    run(1, 2)
    hook = lambda *args: None
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        run(1, 2)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    run(1, 2)
    assert [c[0] for c in jit.calls] == ["jit", "jit", "run"]


def test_launch_leaves_a_kernel_with_an_unpassed_parameter_to_the_jit(device_stub):
    jit = _Jit()
    run = launch.Launch(jit, (1,), dict(C=1))  # D left to its default
    run(1, 2), run(1, 2)
    assert [c[0] for c in jit.calls] == ["jit", "jit"]
