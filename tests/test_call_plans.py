"""The training forward's and backward's launch plans (attncc/runtime/call_plans.py).

A call like an earlier one (the same plan key) runs the earlier call's choices without
the roles or the tuner, and on a GPU relaunches the compiled kernels directly. The tests
hold a plan to its promise both ways: a call it fits runs on that call's own tensors (new
values give the float64 reference's answer, gradients, the sink's and the LSE's
included), and a call it does not fit (another length, stride, 16-byte alignment, dtype
or option) never runs it. A plan copies the tuner's choice, so a choice the tuner no
longer remembers is chosen again. On the JIT's side, a stand-in kernel checks that each
entry point passes every parameter of its kernel, so that on a GPU the plan's launches
leave the JIT after their first call. `attncc check`, which sets the interpreter itself
after attncc is imported, runs its plans too.

On a GPU the same tests run on CUDA tensors, compiled: a test that counts launches or
choices pins what a GPU would otherwise tune (ATTNCC_TUNE, a config).
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import attncc
from attncc.backends.tile_config import TileConfig
from attncc.runtime import call_plans, launch, ops, tuning
from attncc.runtime.kernel import Kernel

SLIDING_SINK = """attention sliding_sink {
    heads 3 / 1
    learnable input sinks: f32[h]
    mask q >= k and q - k < 6
    sink sinks[h]
}"""
CAUSAL = "attention causal { mask q >= k }"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the interpreter


def tensors(seed, *, len_q=9, len_k=9, heads=(3, 1), dim=16, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads[0], len_q, dim, generator=gen).to(dtype)
    k = torch.randn(1, heads[1], len_k, dim, generator=gen).to(dtype)
    v = torch.randn(1, heads[1], len_k, dim, generator=gen).to(dtype)
    sinks = torch.randn(heads[0], generator=gen)
    return tuple(t.to(DEVICE) for t in (q, k, v, sinks))


def _grads(fn, q, k, v, sinks, seed):
    """fn's output, LSE and the gradients of a loss of both (fresh weights from `seed`)."""
    q, k, v, sinks = (t.detach().clone().requires_grad_() for t in (q, k, v, sinks))
    out, lse = fn(q, k, v, sinks)
    gen = torch.Generator().manual_seed(seed)
    w_out = torch.randn(out.shape, generator=gen).to(out.device, out.dtype)
    w_lse = torch.randn(lse.shape, generator=gen).to(lse.device, lse.dtype)
    ((out * w_out).sum() + (lse * w_lse).sum()).backward()
    return out, lse, q.grad, k.grad, v.grad, sinks.grad


def _check_against_reference(kernel, q, k, v, sinks, seed):
    got = _grads(lambda *t: kernel(*t[:3], sinks=t[3], return_lse=True), q, k, v, sinks, seed)
    ref = _grads(lambda *t: attncc.reference(kernel.variant, *t[:3], sinks=t[3],
                                             return_lse=True),
                 *(t.double() for t in (q, k, v, sinks)), seed)
    for name, g, r in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, ref):
        assert not torch.isnan(g).any(), name
        error = (g.double() - r).abs().max()
        assert torch.allclose(g.double(), r, atol=2e-4, rtol=1e-4), (name, error)


class Counting:
    """Counts the calls the first call of a kind makes and a planned one does not."""

    def __init__(self, monkeypatch):
        self.roles = 0

        def counted(original):
            def role(*args, **kwargs):
                self.roles += 1
                return original(*args, **kwargs)
            return role
        for name in ("forward_role", "backward_role", "one_launch_role"):
            monkeypatch.setattr(Kernel, name, counted(getattr(Kernel, name)))


def test_a_repeated_call_runs_its_plan_on_its_own_tensors(monkeypatch):
    kernel = attncc.compile(SLIDING_SINK)
    _grads(lambda *t: kernel(*t[:3], sinks=t[3], return_lse=True), *tensors(0), seed=0)
    assert len(kernel._call_plans) == 2  # its forward's and its backward's (with dLSE)
    counting = Counting(monkeypatch)
    # New values everywhere, the sinks included: the plans read this call's tensors.
    _check_against_reference(kernel, *tensors(1), seed=1)
    assert counting.roles == 0 and len(kernel._call_plans) == 2
    assert kernel.last_backward.keys() == {"dq", "dkdv"} and kernel.last_backend[0] == "triton"


def test_another_length_stride_alignment_dtype_or_option_gets_a_plan_of_its_own(monkeypatch):
    kernel = attncc.compile(SLIDING_SINK)
    q, k, v, sinks = tensors(2)
    with torch.no_grad():
        kernel(q, k, v, sinks=sinks)
    counting = Counting(monkeypatch)
    storage = torch.randn(q.numel() + 1, device=DEVICE)
    unaligned = storage[1:].view(q.shape)  # 4 bytes past a 16-byte boundary
    unaligned.copy_(q)
    assert unaligned.data_ptr() % 16
    calls = {
        "length": tensors(3, len_q=5, len_k=5),
        "strides": tuple(t.transpose(1, 2).contiguous().transpose(1, 2) if t.dim() == 4 else t
                         for t in tensors(4)),
        "alignment": (unaligned, k, v, sinks),
        "dtype": (*(t.half() for t in tensors(5)[:3]), tensors(5)[3]),
    }
    for n, (name, (q2, k2, v2, s2)) in enumerate(calls.items()):
        with torch.no_grad():
            out = kernel(q2, k2, v2, sinks=s2)
        assert counting.roles == n + 1 and len(kernel._call_plans) == n + 2, name
        ref = attncc.reference(kernel.variant, q2.double(), k2.double(), v2.double(),
                               sinks=s2.double())
        atol = 2e-3 if q2.dtype == torch.float16 else 2e-4
        assert torch.allclose(out.double(), ref, atol=atol), name
    with torch.no_grad():
        kernel(q, k, v, sinks=sinks, q_offset=3, k_offset=3)  # an option the key holds
    assert counting.roles == len(calls) + 1


def test_a_planned_backward_under_normalize_none_gives_the_gradients_without_delta(monkeypatch):
    """Sigmoid attention (no normaliser, so no delta) with a learnable bias: the planned
    dQ reads no O, as the first call's did, and its gradients, the bias's included, are
    the float64 reference's on new values."""
    kernel = attncc.compile("attention sigmoid_bias { learnable input bias: f32[h]  "
                            "mask q >= k  normalize none  weight sigmoid(s + bias[h]) }")

    def grads(fn, seed):
        q, k, v, bias = (t.detach().clone().requires_grad_()
                         for t in tensors(seed, len_q=7, len_k=10, heads=(2, 2)))
        out = fn(q, k, v, bias)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
        (out * w.to(out.device, out.dtype)).sum().backward()
        return out, q.grad, k.grad, v.grad, bias.grad

    ours = lambda q, k, v, bias: kernel(q, k, v, bias=bias)
    grads(ours, 12)
    counting = Counting(monkeypatch)
    read_o = []  # per backward launch, whether it was given O
    for name in ("backward_dq", "backward_dkdv"):
        entry = getattr(kernel.module, name)
        monkeypatch.setattr(kernel.module, name, lambda *a, entry=entry, **kw: read_o.append(
            kw.get("out") is not None) or entry(*a, **kw))
    got = grads(ours, 13)
    ref = grads(lambda q, k, v, bias: attncc.reference(
        kernel.variant, q.double(), k.double(), v.double(), bias=bias.double()), 13)
    assert counting.roles == 0 and read_o == [False, False]
    for name, g, r in zip(("out", "dq", "dk", "dv", "dbias"), got, ref):
        assert not torch.isnan(g).any(), name
        error = (g.double() - r.double()).abs().max()
        assert torch.allclose(g.double(), r.double(), atol=2e-4, rtol=1e-4), (name, error)


def test_a_repeated_table_driven_call_runs_its_one_launch_plan_on_new_tables(monkeypatch):
    """A layout variant's backward (delta pass, then dK/dV and dQ in one launch) runs its
    plan on the next call like it, whose layout is another: the tables are the call's
    own (built from its layout), the gradients the float64 reference's."""
    kernel = attncc.compile("attention lay { input blocks: bool[h, qb, kb] "
                            "layout blocks[h, qb, kb] block 16 }")

    def grads(fn, seed):
        gen = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(1, 1, 40, 16, generator=gen).to(DEVICE).requires_grad_()
                   for _ in range(3))
        blocks = (torch.rand(1, 3, 3, generator=gen) < 0.5) | torch.eye(3, dtype=torch.bool)
        out = fn(q, k, v, blocks.to(DEVICE))
        w = torch.randn(out.shape, generator=gen).to(out.device, out.dtype)
        (out * w).sum().backward()
        return out, q.grad, k.grad, v.grad

    ours = lambda q, k, v, blocks: kernel(q, k, v, blocks=blocks)
    grads(ours, 30)
    assert {"bwd"} == set(kernel.last_backward) and len(kernel._call_plans) == 2
    counting = Counting(monkeypatch)
    got = grads(ours, 31)
    ref = grads(lambda q, k, v, blocks: attncc.reference(
        kernel.variant, q.double(), k.double(), v.double(), blocks=blocks), 31)
    assert counting.roles == 0 and len(kernel._call_plans) == 2
    for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
        assert not torch.isnan(g).any(), name
        error = (g.double() - r.double()).abs().max()
        assert torch.allclose(g.double(), r.double(), atol=2e-4, rtol=1e-4), (name, error)


def test_a_choice_the_tuner_forgot_is_chosen_again(monkeypatch):
    """A plan copies the tuner's choice (here put in its memory, as on a GPU): it is
    dropped when the tuner's memory no longer holds that choice."""
    monkeypatch.setattr(tuning, "_MEMORY", {})
    monkeypatch.setattr("attncc.runtime.settings.interpreting", lambda: False)
    # The tuner's memory is read in its default mode alone (a GPU run of the suite may
    # set ATTNCC_TUNE=0, or pin a config, for correctness).
    monkeypatch.delenv("ATTNCC_TUNE", raising=False)
    monkeypatch.delenv("ATTNCC_CONFIG", raising=False)
    kernel = attncc.compile(CAUSAL, backend="triton")
    q, k, v, _ = tensors(6, heads=(2, 2))
    problem = kernel.check_call(q, k, v, {}, 0, 0)

    def remember():
        key = tuning.tuning_key("fwd", problem, q.dtype, None, ("triton",))
        tuning._MEMORY[(kernel.key, key)] = tuning.Choice("triton", TileConfig(16, 16, 4, 1))

    remember()
    chosen = []
    choose = tuning.choose
    monkeypatch.setattr(tuning, "choose", lambda *a, **kw: chosen.append(1) or choose(*a, **kw))
    with torch.no_grad():
        first = kernel(q, k, v)
        again = kernel(q, k, v)
        assert len(chosen) == 1 and torch.equal(first, again)
        remember()  # the same choice, made anew: the tuner's memory changed
        kernel(q, k, v)
    assert len(chosen) == 2


# ------------------------------------------------------------------ the compiled relaunch
class _Compiled:
    function, packed_metadata = "function", "metadata"

    def __init__(self, calls):
        self.calls = calls

    def run(self, *args):
        # What follows the grid, stream, function, metadata and hooks.
        self.calls.append(("run", args[9:]))


class _Jit:
    """A stand-in for one of the module's kernels: its parameters, and a compiled kernel."""

    def __init__(self, kernel):
        self.arg_names = kernel.arg_names
        self.calls = []

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.calls.append(("jit", args, options))
            return _Compiled(self.calls)
        return launch


def test_a_plans_launches_relaunch_the_compiled_kernels_with_what_the_jit_bound(monkeypatch):
    monkeypatch.setattr(launch, "current_device", lambda: 0)
    monkeypatch.setattr(launch, "current_stream", lambda device: 1234)
    # A pinned config: on a GPU the tuner, or a first forward compiling the backward
    # beside it (runtime/scheduling.py), would launch each kernel more often.
    kernel = attncc.compile(SLIDING_SINK.replace("q - k < 6", "q - k < 5"),
                            config=dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1))
    stand_ins = {}
    for name in ("attn_fwd", "attn_bwd_dq", "attn_bwd_dkdv"):
        stand_ins[name] = _Jit(getattr(kernel.module, name))
        monkeypatch.setattr(kernel.module, name, stand_ins[name])
    q, k, v, sinks = (t.requires_grad_() for t in tensors(7))
    for _ in range(3):  # the first call, the plan's first run (the JIT), its relaunch
        out = kernel(q, k, v, sinks=sinks)
        torch.autograd.grad(out.sum(), (q, k, v, sinks))
    for name, jit in stand_ins.items():
        assert [c[0] for c in jit.calls[:2]] == ["jit", "jit"], name
        # Every parameter passed (none left to a default), so the third call relaunched
        # the compiled kernel with the arguments the JIT bound: the positional ones, then
        # the constexprs in parameter order.
        _, args, options = jit.calls[1]
        assert len(jit.calls) == 3 and jit.calls[2][0] == "run", name
        expected = (*args, *(options[n] for n in jit.arg_names[len(args):]))
        relaunched = jit.calls[2][1]
        assert len(relaunched) == len(expected) == len(jit.arg_names), name
        for a, b in zip(relaunched, expected):
            assert type(a) is type(b) and (isinstance(a, torch.Tensor) or a == b), name


def test_a_plan_keeps_no_tensor_of_the_call_it_was_made_from():
    import gc
    import weakref
    kernel = attncc.compile(CAUSAL)
    q, k, v, _ = (t.requires_grad_() for t in tensors(8, heads=(2, 2)))
    kernel(q, k, v).sum().backward()
    made_from = [weakref.ref(t) for t in (q, k, v)]
    del q, k, v
    gc.collect()
    assert len(kernel._call_plans) == 2 and all(ref() is None for ref in made_from)


def test_a_non_tensor_makes_no_plan_key():
    assert call_plans.forward_key(object(), None, None, {}, {}, None) is None


GLUON_PARAMETERS = r'''
import importlib.util, sys, torch, attncc
from attncc.backends.gluon import codegen as gluon
variant = attncc.load(sys.argv[1])
path = sys.argv[2]
open(path, "w").write(gluon.generate(variant).source)
spec = importlib.util.spec_from_file_location("gluon_parameters", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
module._bind_context = lambda device: None  # no GPU: nothing to bind
unpassed, ran = [], []
def launcher(kernel, grid):
    def run(*args, **options):
        unpassed.extend(n for n in kernel.arg_names[len(args):] if n not in options)
        ran.append(kernel)
    return run
q, k, v, do = (torch.randn(1, 4, 256, 64, dtype=torch.bfloat16) for _ in range(4))
lse, delta = torch.randn(1, 4, 256), torch.randn(1, 4, 256)
inputs = {d.name: torch.randn(4) for d in variant.inputs}
# attn_fwd, and the warp-specialized attn_fwd_ws with each count of consumer warpgroups
configs = [dict(BLOCK_M=128, BLOCK_N=128, num_warps=4, num_stages=2)]
configs += [dict(BLOCK_M=64 * consumers, BLOCK_N=128, num_warps=warps, num_stages=2)
            for warps, consumers in module.WS_CONSUMERS.items()]
for config in configs:
    module.forward(q, k, v, inputs, launcher=launcher, config=config)
small = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
module.backward_dq(q, k, v, lse, delta, do, inputs, config=small, out=q, launcher=launcher)
module.backward_dkdv(q, k, v, lse, delta, do, inputs, config=small, launcher=launcher)
assert len(ran) == len(configs) + 2 and unpassed == [], (ran, unpassed)
'''


@pytest.mark.slow
def test_the_gluon_entry_points_pass_every_parameter_of_their_kernels(tmp_path):
    """As the portable test above, for the Gluon module (rendered and imported without
    the interpreter, in a fresh process; its launches go to a recording launcher, on CPU
    tensors): a parameter left to its default would keep a plan's launch on the JIT."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    spec = ("attention s { heads 4 / 4  learnable input sinks: f32[h]  "
            "mask q >= k and q - k < 128  sink sinks[h] }")
    done = subprocess.run([sys.executable, "-c", GLUON_PARAMETERS, spec,
                           str(tmp_path / "gluon_parameters.py")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_call_like_a_checked_one_skips_its_checks_and_any_other_is_checked(monkeypatch):
    """Kernel.__call__ remembers the checks a call passed per call signature: a call that
    differs where the checks look (an input that takes gradients it would not get, in
    grad mode; another dtype) is checked, and refused, as before."""
    kernel = attncc.compile("attention alibi { input slopes: f32[h]  mask q >= k  "
                            "score s + slopes[h] * (k - q) }")
    q, k, v, slopes = tensors(9, heads=(2, 2), len_q=5, len_k=5)
    slopes = slopes[:2]
    with torch.no_grad():
        kernel(q, k, v, slopes=slopes.clone().requires_grad_())  # no gradient asked for
    checked = []
    check_call = Kernel.check_call
    monkeypatch.setattr(Kernel, "check_call",
                        lambda *a, **kw: checked.append(1) or check_call(*a, **kw))
    with torch.no_grad():
        kernel(q, k, v, slopes=slopes.clone().requires_grad_())
    assert checked == []
    with pytest.raises(attncc.CallError, match="requires grad, but the variant does not"):
        kernel(q, k, v, slopes=slopes.clone().requires_grad_())
    with pytest.raises(attncc.CallError, match="has dtype torch.float64"):
        kernel(q, k, v, slopes=slopes.double())
    assert len(checked) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_planned_call_captures_in_a_cuda_graph_and_replays_on_new_values():
    """Eager capture after warm-up calls (the first makes the plans, the second runs them
    through the JIT once): the captured launches read the static tensors' new values and
    give what an eager call gives."""
    kernel = attncc.compile(SLIDING_SINK)
    q, k, v = (t.cuda().half().requires_grad_() for t in tensors(10)[:3])
    sinks = tensors(10)[3].cuda()
    dout = torch.randn_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            torch.autograd.grad(kernel(q, k, v, sinks=sinks), (q, k, v), dout)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel(q, k, v, sinks=sinks)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    with torch.no_grad():
        for static, new in zip((q, k, v), tensors(11)[:3]):
            static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    eager = kernel(q, k, v, sinks=sinks)
    eager_grads = torch.autograd.grad(eager, (q, k, v), dout)
    for got, want in zip((out, *grads), (eager, *eager_grads)):
        assert not torch.isnan(got).any() and torch.allclose(got, want, atol=1e-3, rtol=1e-3)


CHECK_THROUGH_PLANS = r'''
import sys
from attncc.runtime import call_plans  # imported before check sets TRITON_INTERPRET
from attncc.tools.cli import main
planned = []
forward, backward = call_plans.forward, call_plans.backward
call_plans.forward = lambda *a, **kw: planned.append("fwd") or forward(*a, **kw)
call_plans.backward = lambda *a, **kw: planned.append("bwd") or backward(*a, **kw)
code = main(["check", sys.argv[1], "--len", "11,11", "--heads", "3/1", "--dim", "16",
             "--dtype", "float16"])
# The second length is the first again: a call like the first one, run by its plans.
assert code == 0 and planned == ["fwd", "bwd"], (code, planned)
'''


@pytest.mark.slow
def test_attncc_check_runs_its_second_call_through_the_plans_in_a_fresh_process():
    """`attncc check` without TRITON_INTERPRET in the environment (it sets it itself,
    without a GPU) after attncc's runtime was imported: the plans' module must not import
    triton with it, or triton's own JIT functions (tl.cdiv) stay compiled and the
    interpreted kernels cannot call them. On a GPU the check runs compiled, plans too.
    (Slow: ~4 s; the suite's default guard of that import is tests/test_cli.py's
    test_check_sets_the_interpreter_itself_without_a_gpu, which failed on it.)"""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", CHECK_THROUGH_PLANS, SLIDING_SINK],
                          env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.count("OK: every tensor within tolerance") == 1
    assert done.stdout.count("len_q 11, len_k 11") == 2


class _SeesOps(TorchDispatchMode):
    """Runs every op as it is and keeps the names of attncc's (as a tracer sees them)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "attncc":
            self.names.append(func._opname)
        return func(*args, **(kwargs or {}))


@pytest.mark.slow  # ~1.4 s: six interpreted launches
def test_eager_autograd_and_a_tracer_get_the_same_bits_and_the_tracer_sees_the_ops():
    """An eager training call's autograd formula enters the ops' implementations itself
    (one trip through the dispatcher fewer each way: host time, which
    benchmarks/host_overhead.py --cpu measures); anything that traces (here a dispatch
    mode, as AOTAutograd's tracing installs) gets both ops as nodes. The two paths give
    the same bits, forward and backward, the sink's gradient included."""
    kernel = attncc.compile(SLIDING_SINK)
    call = lambda *t: kernel(*t[:3], sinks=t[3], return_lse=True)
    eager = _grads(call, *tensors(20), seed=20)
    tracer = _SeesOps()
    with tracer:
        traced = _grads(call, *tensors(20), seed=20)
    name = ops.op_name(kernel.variant)
    assert tracer.names == [name, name + "_bwd"]
    for what, a, b in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), eager, traced):
        assert torch.equal(a, b), what
