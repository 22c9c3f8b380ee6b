"""Kernels under torch.compile: each variant is a torch.library operator (attncc/runtime/ops.py).

A compiled call must trace with no graph break (`fullgraph=True`), compile once for
every sequence length (the lengths are marked dynamic, so a specialisation would be an
error), and give the eager results bit for bit, forward and backward: the operator runs
the same kernels, with the same configs. On the CPU the kernels run under the Triton
interpreter behind the operator; the backends are aot_eager and inductor. The GPU tests
(skipped without CUDA) add inductor on the device and CUDA graphs.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import sys
import warnings

import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import attncc
from attncc.runtime import ops
from attncc.errors import CallError
from test_kernels import DEVICE

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on one)")

# Analytic bounds only (no tile tables): a causal window with a softcapped score.
WINDOW = "attention w { mask q >= k and q - k < 20 score 30.0 * tanh(s / 30.0) }"
# Tile tables from per-block summaries of an input, a learnable input, and dropout.
DOCUMENTS = """attention docs {
    input doc: i32[q]
    learnable input slope: f32[h]
    mask doc[q] == doc[k] and q >= k
    score s + slope[h] * (k - q)
    dropout 0.2
}"""
# A runtime layout, for kept tables; and index lists, whose values the operator checks.
LAYOUT = "attention lay { input blocks: bool[h, qb, kb] layout blocks[h, qb, kb] block 16 }"
TOPK = "attention top { input sel: i32[h, qb, 2] layout kb in sel[h, qb] block 16 }"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def compiled(fn, backend="aot_eager"):
    """fn compiled whole (a graph break is an error), and its compile counter."""
    counter = CompileCounterWithBackend(backend)
    return torch.compile(fn, backend=counter, fullgraph=True), counter


def dynamic(*tensors, dim=2):
    """Mark the sequence axis dynamic: if tracing fixed it, torch.compile would raise."""
    for t in tensors:
        torch._dynamo.mark_dynamic(t, dim)
    return tensors


def qkv(L, Lk=None, H=2, D=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda n: torch.randn(1, H, n, D, generator=gen).to(DEVICE).requires_grad_()
    return make(L), make(Lk or L), make(Lk or L), torch.randn(1, H, L, D, generator=gen).to(DEVICE)


def outputs_and_grads(fn, tensors, do, *args):
    out, lse = fn(*tensors, *args)
    return [out, lse, *torch.autograd.grad(out, tensors, do)]


def assert_bitwise(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"result {i} differs from eager"


def no_graph_breaks():
    return sum(counters["graph_break"].values()) == 0


# ------------------------------------------------------------------ results and compiles
@pytest.mark.parametrize("backend", [pytest.param("aot_eager", marks=pytest.mark.slow), "inductor"])
def test_compiled_call_equals_eager_for_every_length_with_one_compile(backend):
    kernel = attncc.compile(WINDOW)
    call = lambda q, k, v: kernel(q, k, v, return_lse=True)
    fn, counter = compiled(call, backend)
    for Lq, Lk in ((40, 33), (27, 48)):  # len_q != len_k, neither a multiple of the tile
        q, k, v, do = qkv(Lq, Lk)
        dynamic(q, k, v)
        assert_bitwise(outputs_and_grads(fn, (q, k, v), do), outputs_and_grads(call, (q, k, v), do))
    assert counter.frame_count == 1, "a new sequence length recompiled"
    assert no_graph_breaks()


def test_inputs_learnable_gradients_dropout_seed_and_offsets_pass_through():
    kernel = attncc.compile(DOCUMENTS)

    def call(q, k, v, doc, slope, seed, offset):
        return kernel(q, k, v, doc=doc, slope=slope, dropout_seed=seed, q_offset=offset,
                      k_offset=offset, return_lse=True)

    fn, counter = compiled(call)
    for L, seed, offset in ((32, 3, 0), (21, 8, 5), (27, 1, 2)):
        q, k, v, do = qkv(L)
        slope = torch.rand(2, device=DEVICE, requires_grad=True)
        doc = torch.sort(torch.randint(0, 3, (offset + L,))).values.to(torch.int32).to(DEVICE)
        dynamic(q, k, v)
        dynamic(doc, dim=0)

        def run(f):
            out, lse = f(q, k, v, doc, slope, seed, offset)
            return [out, lse, *torch.autograd.grad(out, (q, k, v, slope), do)]

        got, want = run(fn), run(call)
        assert_bitwise(got, want)
        assert got[-1].abs().sum() > 0, "the learnable input got no gradient"
    # The first call compiles with the seed and offsets as constants; the second, which
    # changes them, makes them symbolic once; the third compiles nothing.
    assert counter.frame_count == 2
    assert no_graph_breaks()


def test_a_seed_drawn_in_the_call_is_fresh_on_every_compiled_run():
    kernel = attncc.compile("attention d { mask q >= k dropout 0.3 }")
    call = lambda q, k, v: kernel(q, k, v)
    fn, counter = compiled(call)
    q, k, v, do = qkv(40)
    first, second = fn(q, k, v), fn(q, k, v)
    assert not torch.equal(first, second), "two runs dropped the same elements"
    # Drawn from torch's generator, in the graph: torch.manual_seed reproduces eager.
    torch.manual_seed(5)
    got = outputs_and_grads(lambda *t: (fn(*t), None), (q, k, v), do)[::2]
    torch.manual_seed(5)
    want = outputs_and_grads(lambda *t: (call(*t), None), (q, k, v), do)[::2]
    assert_bitwise(got, want)
    assert counter.frame_count == 1 and no_graph_breaks()


def test_training_false_runs_the_variant_without_dropout():
    kernel = attncc.compile("attention d { mask q >= k dropout 0.3 }")
    call = lambda q, k, v: kernel(q, k, v, training=False)
    fn, _ = compiled(call)
    q, k, v, _ = qkv(40)
    got = fn(q, k, v)
    assert torch.equal(got, call(q, k, v))
    assert torch.equal(got, attncc.compile("attention d { mask q >= k }")(q, k, v))


# ------------------------------------------------------------------ kept tile tables
def test_kept_tables_pass_through_and_are_checked_in_the_operator():
    kernel = attncc.compile(LAYOUT)
    q, k, v, do = qkv(40)  # 3 blocks of 16
    blocks = (torch.rand(2, 3, 3, generator=torch.Generator().manual_seed(1)) < 0.6).to(DEVICE)
    blocks[:, :, 0] = True
    tables = kernel.tile_tables(q, k, v, blocks=blocks)
    call = lambda q, k, v, blocks: kernel(q, k, v, blocks=blocks, tables=tables, return_lse=True)
    fn, counter = compiled(call)
    assert_bitwise(outputs_and_grads(fn, (q, k, v), do, blocks),
                   outputs_and_grads(call, (q, k, v), do, blocks))
    assert tables.store, "the operator filled the kept tables"
    # The tables' inputs are checked where tensors are real: in the operator, at run time.
    with pytest.raises(CallError, match="built from another 'blocks'"):
        fn(q, k, v, blocks.clone())
    with torch.no_grad():
        blocks[0, 0, 1] = ~blocks[0, 0, 1]  # in place: the tables are stale
    with pytest.raises(CallError, match="written in place since"):
        fn(q, k, v, blocks)
    assert counter.frame_count == 1 and no_graph_breaks()
    # Other tables are another constant of the graph: Dynamo guards on them, retraces.
    other = torch.eye(3, dtype=torch.bool, device=DEVICE).expand(2, 3, 3).contiguous()
    tables = kernel.tile_tables(q, k, v, blocks=other)
    assert_bitwise(outputs_and_grads(fn, (q, k, v), do, other),
                   outputs_and_grads(call, (q, k, v), do, other))
    assert counter.frame_count == 2


def test_tables_of_another_shape_are_refused_while_tracing():
    kernel = attncc.compile(LAYOUT)
    q, k, v, _ = qkv(40)
    blocks = torch.ones(2, 3, 3, dtype=torch.bool, device=DEVICE)
    tables = kernel.tile_tables(q, k, v, blocks=blocks)
    q2, k2, v2, _ = qkv(33)
    call = lambda q, k, v: kernel(q, k, v, blocks=blocks, tables=tables)
    match = "these tables were built for .* len_q 40, .* but this call is .* len_q 33"
    with pytest.raises(CallError, match=match):
        torch.compile(call, backend="aot_eager")(q2, k2, v2)
    with pytest.raises(Exception) as error:
        torch.compile(call, backend="aot_eager", fullgraph=True, dynamic=True)(q2, k2, v2)
    assert re.search(match, error_chain(error.value))


# ------------------------------------------------------------------ errors
def bad_calls():
    q, k, v, _ = qkv(40)
    doc = torch.zeros(40, dtype=torch.int32, device=DEVICE)
    other = lambda *shape: torch.randn(*shape, device=DEVICE)
    return [((q, k, v, doc.long()), "input 'doc' has dtype torch.int64"),
            ((q, k, v, doc[:-1]), r"input 'doc' has shape \(39,\), expected \(40,\) \(q=40\)"),
            ((other(1, 3, 40, 16), k, v, doc), "q has 3 heads, which is not a multiple of the 2"),
            ((q, k, other(1, 2, 40, 8), doc), r"v's head dim 8 is not supported: .* \(1, 2, 40, 8\)"),
            ((q[..., :8], k[..., :8], v[..., :8], doc), r"head dim 8 is not supported: .* \(1, 2, 40, 8\)")]


def error_chain(e) -> str:
    texts = []
    while e is not None and len(texts) < 8:
        texts.append(str(e))
        e = e.__cause__ or e.__context__
    return "\n".join(texts)


def test_bad_calls_raise_the_eager_call_errors():
    kernel = attncc.compile("attention d { input doc: i32[q] mask doc[q] == doc[k] and q >= k }")
    call = lambda q, k, v, doc: kernel(q, k, v, doc=doc)
    for args, match in bad_calls():
        with pytest.raises(CallError, match=match):
            call(*args)  # eager
        # With fullgraph, Dynamo reports the CallError it met while tracing, with its text
        # (in its message or the exceptions it chains, depending on the PyTorch version),
        # also where sizes are symbolic.
        fn = torch.compile(call, backend="aot_eager", fullgraph=True, dynamic=True)
        with pytest.raises(Exception) as error:
            fn(*args)
        assert re.search(match, error_chain(error.value)), error_chain(error.value)
    # Without fullgraph, Dynamo gives up on the frame and the call raises as in eager.
    args, match = bad_calls()[1]
    with pytest.raises(CallError, match=match):
        torch.compile(call, backend="aot_eager")(*args)


def test_index_list_values_are_checked_in_the_operator():
    # Checking values reads data: not at trace time (FakeTensors have none), but in the
    # operator on every new or modified list, as in eager.
    kernel = attncc.compile(TOPK)
    q, k, v, do = qkv(40)
    sel = torch.tensor([[[0, -1], [1, 0], [2, 1]]] * 2, dtype=torch.int32, device=DEVICE)
    call = lambda q, k, v, sel: kernel(q, k, v, sel=sel, return_lse=True)
    fn, _ = compiled(call)
    assert_bitwise(outputs_and_grads(fn, (q, k, v), do, sel), outputs_and_grads(call, (q, k, v), do, sel))
    bad = sel.clone()
    bad[1, 2, 0] = 1  # tile 1 twice
    with pytest.raises(CallError, match="input 'sel' lists tile 1 twice"):
        fn(q, k, v, bad)
    bad[1, 2, 0] = 7
    with pytest.raises(CallError, match="input 'sel' holds tile index 7"):
        fn(q, k, v, bad)
    assert no_graph_breaks()


# ------------------------------------------------------------------ the operators
def test_operators_are_registered_once_per_variant_and_pass_opcheck():
    kernel = attncc.compile(DOCUMENTS)
    forward, backward = kernel._ops.forward, kernel._ops.backward
    assert attncc.compile(DOCUMENTS)._ops is kernel._ops, "registered once"
    assert forward is getattr(torch.ops.attncc, ops.op_name(kernel.variant)).default
    assert backward is getattr(torch.ops.attncc, ops.op_name(kernel.variant) + "_bwd").default
    q, k, v, _ = qkv(24)
    doc = torch.tensor([0] * 10 + [1] * 14, dtype=torch.int32, device=DEVICE)
    slope = torch.rand(2, device=DEVICE, requires_grad=True)
    # Schema, fake implementation, autograd registration and AOT dispatch (dynamic).
    torch.library.opcheck(forward, (kernel._op_id, q, k, v, [doc, slope], 0, 0, 4, None, 0, True),
                          test_utils=("test_schema", "test_faketensor",
                                      "test_autograd_registration", "test_aot_dispatch_dynamic"))


def test_the_autograd_graph_keeps_its_kernel_and_tables_alive():
    # The operators find kernels and tables through weak registries; a backward must
    # still find those of its forward when nothing else holds them.
    import gc
    q, k, v, do = qkv(20)
    blocks = torch.ones(2, 2, 2, dtype=torch.bool, device=DEVICE)

    def forward():  # neither the kernel nor its tables outlive the call but in the graph
        kernel = attncc.compile(LAYOUT)
        return kernel(q, k, v, blocks=blocks, tables=kernel.tile_tables(q, k, v, blocks=blocks))

    out = forward()
    gc.collect()
    grads = torch.autograd.grad(out, (q, k, v), do)
    assert all(torch.isfinite(g).all() for g in grads)


def test_a_graph_outliving_its_kernel_says_so():
    from attncc.runtime import ops
    kernel = attncc.compile(WINDOW)
    q, k, v, _ = qkv(20)
    forward = kernel._ops.forward
    gone = ops.register_kernel(kernel) + 1_000_000  # an id no kernel has
    with pytest.raises(CallError, match="no longer exists"):
        forward(gone, q, k, v, [], 0, 0, 0, None, ops.NO_TABLES, True)


# ------------------------------------------------------------------ a model
def test_a_compiled_model_trains_like_eager():
    # Projections around the kernel, several layers, forward and backward, two lengths.
    class Block(torch.nn.Module):
        def __init__(self, kernel, dim=32, heads=2):
            super().__init__()
            self.kernel, self.heads = kernel, heads
            self.qkv = torch.nn.Linear(dim, 3 * dim)
            self.proj = torch.nn.Linear(dim, dim)

        def forward(self, x):
            B, L, C = x.shape
            q, k, v = self.qkv(x).view(B, L, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
            y = self.kernel(q, k, v).transpose(1, 2).reshape(B, L, C)
            return x + self.proj(y)

    torch.manual_seed(0)
    kernel = attncc.compile(WINDOW)
    model = torch.nn.Sequential(Block(kernel), Block(kernel)).to(DEVICE)
    fn, counter = compiled(model)
    grads = lambda f, x: torch.autograd.grad(f(x).square().mean(), list(model.parameters()))
    for L in (40, 29):
        x = torch.randn(1, L, 32, device=DEVICE)
        dynamic(x, dim=1)
        assert_bitwise(grads(fn, x), grads(model, x))
    assert counter.frame_count == 1 and no_graph_breaks()


# ------------------------------------------------------------------ GPU
def gpu_qkv(L, dtype, D=64):
    q, k, v, do = qkv(L, D=D)
    return (*(t.detach().to(dtype).requires_grad_() for t in (q, k, v)), do.to(dtype))


@GPU
@pytest.mark.parametrize("spec", [WINDOW, LAYOUT], ids=["analytic", "tables"])
def test_inductor_on_the_gpu_equals_eager(spec):
    kernel = attncc.compile(spec)
    call = lambda q, k, v, extra: kernel(q, k, v, return_lse=True, **extra)
    fn, counter = compiled(call, "inductor")
    for L in (256, 200):
        q, k, v, do = gpu_qkv(L, torch.bfloat16)
        dynamic(q, k, v)
        extra = {}
        if spec == LAYOUT:
            n = -(-L // 16)
            extra["blocks"] = (torch.rand(2, n, n, device="cuda") < 0.5) | torch.eye(n, dtype=torch.bool, device="cuda")
            dynamic(extra["blocks"], dim=1)
            dynamic(extra["blocks"], dim=2)
        assert_bitwise(outputs_and_grads(fn, (q, k, v), do, extra),
                       outputs_and_grads(call, (q, k, v), do, extra))
    assert counter.frame_count == 1 and no_graph_breaks()


@GPU
def test_a_compiled_training_step_replays_in_cuda_graphs():
    # mode="reduce-overhead": inductor captures the forward and the backward in CUDA
    # graphs after a warm-up run (which tunes), then replays them.
    kernel = attncc.compile(WINDOW)
    forward = lambda q, k, v: kernel(q, k, v)

    q, k, v, do = gpu_qkv(256, torch.float16)

    def step(f):
        torch.compiler.cudagraph_mark_step_begin()  # a new iteration: outputs may be reused
        out = f(q, k, v)
        return [t.clone() for t in (out, *torch.autograd.grad(out, (q, k, v), do))]

    want = step(forward)
    fn = torch.compile(forward, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):  # warm-up, record, replays
        assert_bitwise(step(fn), want)
    assert counters["inductor"]["cudagraph_skips"] == 0, "the step was not captured"


@GPU
def test_a_compiled_call_with_kept_tables_captures_in_a_cuda_graph():
    # Kept tables make no host sync in a call. Captured by hand (torch.cuda.graph), the
    # tensors the tables read keep their addresses, so their check passes at capture.
    kernel = attncc.compile(LAYOUT)
    q, k, v, do = gpu_qkv(200, torch.float16)
    blocks = (torch.rand(2, 13, 13, generator=torch.Generator().manual_seed(3)) < 0.5).cuda()
    tables = kernel.tile_tables(q, k, v, blocks=blocks)
    fn = torch.compile(lambda q, k, v: kernel(q, k, v, blocks=blocks, tables=tables), fullgraph=True)
    step = lambda f: torch.autograd.grad(f(q, k, v), (q, k, v), do)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(fn)  # compiles, tunes, builds the tables of each tile size
    torch.cuda.current_stream().wait_stream(side)
    want = step(lambda q, k, v: kernel(q, k, v, blocks=blocks, tables=tables))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(fn)
    for t in captured:
        t.fill_(float("nan"))
    graph.replay()
    assert_bitwise(captured, want)


# ------------------------------------------------------------------ examples/train_gpt.py
def _train_gpt():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parent.parent / "examples" / "train_gpt.py"
    spec = importlib.util.spec_from_file_location("train_gpt", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_gpt"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # 12 s under the interpreter: the CI budget
def test_train_gpt_compiled_trains_like_the_reference_model():
    # The example's CPU run: the compiled model with attncc's operator against the same
    # model, eager, with attncc.reference attention: same weights, same batches.
    tg = _train_gpt()
    config = dataclasses.replace(tg.TINY, seq=32)  # two tiles of 16 per row: several documents
    got = tg.train("attncc", config, steps=2, compile_backend="aot_eager", device=DEVICE)
    assert no_graph_breaks()
    want = tg.train("reference", config, steps=2, compile_backend=None, device=DEVICE)
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5)
    assert got["losses"][0] == pytest.approx(math.log(config.vocab), rel=0.05)


def test_train_gpt_bench_backends_compute_the_variant():
    # What --bench times on the GPU, checked here: FlexAttention's mask_mod and
    # score_mod and SDPA's dense mask against the reference (SDPA: without softcap).
    tg = _train_gpt()
    with warnings.catch_warnings():  # eager flex_attention warns that it is slow
        warnings.simplefilter("ignore")
        rows = tg.check_attention(tg.TINY, DEVICE, torch.float32, L=40)
    assert [r["backend"] for r in rows] == ["attncc", "flex", "flex_flash", "sdpa"]
    flash = rows.pop(2)  # FlashAttention-4's kernels: a CUDA GPU with flash-attn-4 installed
    if importlib.util.find_spec("flash_attn") is None:
        assert "install flash-attn-4" in flash["error"] and not flash["ok"]
    else:
        rows.append(flash)
    assert all(r["ok"] for r in rows), rows
    # The SDPA mask differs from the variant only by the softcap it cannot apply.
    doc = torch.tensor([[0] * 20 + [1] * 20], dtype=torch.int32)
    mask = tg.SdpaAttention(tg.TINY).prepare(doc)[0, 0]
    assert mask[25, 21] and not mask[25, 19] and not mask[19, 20] and not mask[19, 3]


def test_train_gpt_bench_table_and_gpu_requirement(monkeypatch, capsys):
    tg = _train_gpt()
    run = lambda backend, softcap=True: {"backend": backend, "losses": [3.0, 2.5], "timed_steps": 2,
                                         "step_ms": 10.0, "tokens_per_s": 1e5, "wall_s": 5.0,
                                         "peak_gib": 1.5, "graph_breaks": 0, "softcap": softcap}
    result = {"config": dataclasses.asdict(tg.GPU), "gpu": "H100", "torch": "2.11", "triton": "3.6",
              "checks": [{"backend": "attncc", "len": 1000, "max_abs_error": 1e-3, "eager_error": 2e-3, "ok": True}],
              "runs": [run("attncc"), run("sdpa", softcap=False),
                       {"backend": "flex", "error": "boom", "wall_s": 1.0}]}
    result["checks"].append({"backend": "flex_flash", "len": 1000, "ok": False,
                             "error": "RuntimeError: install flash-attn-4"})
    table = tg.format_table(result)
    assert "attncc ok" in table and "mask only: SDPA cannot softcap" in table
    assert "flex       failed: boom" in table and "100000" in table
    assert "flex_flash did not run (RuntimeError: install flash-attn-4)" in table
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tg.main(["--bench"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@GPU
def test_kept_tables_under_reduce_overhead_need_their_layout_at_a_static_address():
    # Inductor's CUDA graphs copy inputs that are not static into buffers of their own
    # for the recording; the tables' check sees another tensor there and says what to do.
    kernel = attncc.compile(LAYOUT)
    q, k, v, _ = gpu_qkv(200, torch.float16)
    blocks = (torch.rand(2, 13, 13, generator=torch.Generator().manual_seed(3)) < 0.5).cuda()
    tables = kernel.tile_tables(q, k, v, blocks=blocks)
    want = kernel(q, k, v, blocks=blocks, tables=tables)
    call = lambda q, k, v, blocks: kernel(q, k, v, blocks=blocks, tables=tables)
    fn = torch.compile(call, mode="reduce-overhead", fullgraph=True)
    with pytest.raises(CallError, match="mark_static_address"):
        for _ in range(3):
            torch.compiler.cudagraph_mark_step_begin()
            fn(q, k, v, blocks)
    torch._dynamo.reset()
    torch._dynamo.mark_static_address(blocks)
    fn = torch.compile(call, mode="reduce-overhead", fullgraph=True)
    for _ in range(4):  # warm-up, record, replays
        torch.compiler.cudagraph_mark_step_begin()
        assert torch.equal(fn(q, k, v, blocks), want)
    assert counters["inductor"]["cudagraph_skips"] == 0


def test_op_names_change_with_the_ops_schemas():
    """A graph torch.compile cached on disk calls the ops by name: an attncc whose
    backward op takes other arguments must give its ops other names, or a stale cached
    backward would call the new op with the old argument list."""
    variant = attncc.parse(DOCUMENTS)
    before = ops.op_name(variant)
    assert before.startswith(f"{variant.name}_{variant.key()}_")
    schema = ops.BACKWARD_SCHEMA
    try:
        ops._revision.cache_clear()
        ops.BACKWARD_SCHEMA = schema.replace("Tensor? dlse, ", "")
        assert ops.op_name(variant) != before
    finally:
        ops.BACKWARD_SCHEMA = schema
        ops._revision.cache_clear()
    assert ops.op_name(variant) == before
