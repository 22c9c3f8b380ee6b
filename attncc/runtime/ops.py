"""PyTorch operators for compiled variants: a torch.library custom op per variant.

`Kernel.__call__` checks a call in Python and then calls the variant's forward op,
`torch.ops.attncc.<name>_<key>_<revision>` (`op_name`); its autograd kernel (an
autograd.Function) calls the backward op, `..._bwd`. Each op has a real implementation (the
generated module's launches, tuning included) and a fake one (empty outputs of the right
shapes and strides), so torch.compile traces a call as one opaque node, with symbolic
sequence lengths, and never traces into Triton's launch path, the tuner or the table
caches; and since the backward is an op too, AOTAutograd traces it the same way.

What crosses the op boundary, and how:
- q, k, v and the variant's inputs (a Tensor[] in declared order), then the call's
  options: a `CallOptions` record (attncc/runtime/call_options.py) spelt out field by
  field, each in the schema type its field declares. The schemas, the fake
  implementations and the autograd formula's saved call are made from its fields, so a
  new option is a new field there and nothing here.
- The backward takes the LSE's gradient as an optional tensor, `dlse`: None when no
  loss reads the LSE (autograd's grads are not materialised), so that case reads no
  tensor of zeros and launches what it did before the LSE was differentiable.
- The Kernel and its kept TileTables (the record's `tables`) as int ids into
  process-wide registries (weak: an id outlives nothing). The tensors tables are built
  from already pass through as inputs. An id is a constant in a traced graph, so
  another TileTables object is another graph (Dynamo guards on the object).
- The checks that read tensor data (index-list values, the state of the tensors kept
  tables were built from) run in the real implementation, where tensors are real: under
  torch.compile the Python call checks run at trace time on FakeTensors, and these
  could not. In eager mode the op runs inside the call, so the errors are the same.
"""
from __future__ import annotations

import functools
import itertools
import weakref
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from . import precompile, scheduling, settings, sinks
from ..arguments import Problem, as_bhsd
from .call_options import NO_TABLES, CallOptions
from .decoding import DecodeOptions, run_decode
from ..errors import CallError
from ..version import __version__

_KERNELS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_TABLES: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_IDS = itertools.count(1)  # never reused, so a stale id finds nothing rather than another object
_OPS: dict = {}  # op name -> Operators; defined once per process and variant


def register_kernel(kernel) -> int:
    op_id = next(_IDS)
    _KERNELS[op_id] = kernel
    return op_id


def register_tables(tables) -> int:
    op_id = next(_IDS)
    _TABLES[op_id] = tables
    return op_id


def op_name(variant) -> str:
    return f"{variant.name}_{variant.key()}_{_revision()}"


@functools.cache
def _revision() -> str:
    """A short hash of what a compiled graph assumes about the ops: their schemas and the
    code of this module (autograd, ops) and of the call records (call_options.py).
    torch.compile's caches (AOTAutograd's and Inductor's, on disk, shared by every
    process of the user) store traced graphs that call the ops by name; an attncc whose
    `_bwd` op took one argument more, under the same name, would be called by a stale
    cached backward with the old argument list (seen when the LSE became
    differentiable). Naming the revision makes such a graph miss the cache instead."""
    import hashlib
    records = Path(__file__).with_name("call_options.py")
    text = "\n".join((FORWARD_SCHEMA, BACKWARD_SCHEMA, DECODE_SCHEMA, __version__,
                      Path(__file__).read_text(), records.read_text()))
    return hashlib.sha256(text.encode()).hexdigest()[:8]


class Operators(NamedTuple):
    forward: torch._ops.OpOverload  # torch.ops.attncc.<op_name>.default
    backward: torch._ops.OpOverload  # torch.ops.attncc.<op_name>_bwd.default
    # The forward op's autograd kernel, for eager calls to enter directly: with the same
    # arguments and results as `forward` (and `layout=`, the caller's "bshd", whose
    # views it makes itself: see Attention), one trip through the dispatcher fewer (~20
    # us of host time on a slow CPU). In eager mode it runs the ops' implementations
    # itself (another trip fewer each way, `_eager`); traced, it calls the ops.
    apply: Callable


def operators(kernel) -> Operators:
    """The ops of the kernel's variant, defined on first use."""
    name = op_name(kernel.variant)
    if name not in _OPS:
        learnable = [i for i, d in enumerate(kernel.variant.inputs) if d.learnable]
        _OPS[name] = _define(name, learnable, CallOptions, _forward, _backward)
    return _OPS[name]


def _kernel(op_id: int):
    kernel = _KERNELS.get(op_id)
    if kernel is None:
        raise CallError(f"attncc kernel #{op_id} no longer exists: a graph traced with it "
                        "outlived it; keep the kernel (attncc.compile's result) alive while "
                        "compiled code calls it")
    return kernel


def _tables(op_id: int):
    if op_id == NO_TABLES:
        return None
    tables = _TABLES.get(op_id)
    if tables is None:
        raise CallError(f"the tile tables #{op_id} passed as tables= no longer exist: keep a "
                        "reference to kernel.tile_tables(...)'s result while calls use it")
    return tables


def _problem(q, k, v, q_offset, k_offset) -> Problem:
    return _problem_of(q.shape, k.shape, v.shape[3], q_offset, k_offset)


@functools.lru_cache(maxsize=256)
def _problem_of(q_shape, k_shape, dim_v, q_offset, k_offset) -> Problem:
    # Cached: a frozen dataclass costs microseconds to build, and this runs on every call.
    B, H, Lq, D = q_shape
    return Problem(B, H, k_shape[1], Lq, k_shape[2], D, dim_v, q_offset, k_offset)


# One library fragment for every variant's ops. torch.library.custom_op would do the
# same with less code, but its implementations import torch._dynamo (and sympy) on
# first call, a second or more of a warm start, and its generic autograd wrapper (pytree
# flattening per call) cost ~130 us of host time per call on a 2-core CPU; a plain
# Library definition, a fake implementation and an autograd.Function of our own cost a
# few microseconds over the autograd.Function that ran the kernels before.
_LIBRARY = torch.library.Library("attncc", "FRAGMENT")

def forward_schema(record) -> str:
    """The forward op's schema for calls whose options are the call record `record`."""
    return (f"(int kernel, Tensor q, Tensor k, Tensor v, Tensor[] inputs, "
            f"{record.schema_arguments()}) -> (Tensor, Tensor)")


def backward_schema(record) -> str:
    """The backward op's schema: the forward's arguments, its results and their gradients
    (dlse None where no loss reads the LSE) in; the gradients of q, k, v and of the
    learnable inputs out."""
    return (f"(int kernel, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor dout, "
            f"Tensor? dlse, Tensor[] inputs, {record.schema_arguments()}) "
            f"-> (Tensor, Tensor, Tensor, Tensor[])")


FORWARD_SCHEMA = forward_schema(CallOptions)
BACKWARD_SCHEMA = backward_schema(CallOptions)


def _define(name: str, learnable: list, record, forward_impl, backward_impl) -> Operators:
    """The ops `name` (forward) and `name`_bwd for calls whose options are the call record
    `record` (CallOptions, or a test's record with a field more); the inputs at indices
    `learnable` take gradients. `forward_impl` and `backward_impl` are the real
    implementations: they take the record's fields last (`*options`)."""
    _LIBRARY.define(name + forward_schema(record))
    _LIBRARY.define(name + "_bwd" + backward_schema(record))
    forward = getattr(torch.ops.attncc, name).default
    backward = getattr(torch.ops.attncc, name + "_bwd").default
    # The real implementations serve every device (the kernels take CUDA tensors, and
    # CPU ones under the interpreter); the fake ones, FakeTensors (torch.compile).
    _LIBRARY.impl(name, forward_impl, "CompositeExplicitAutograd")
    _LIBRARY.impl(name + "_bwd", backward_impl, "CompositeExplicitAutograd")

    def forward_fake(kernel, q, k, v, inputs, *options):
        # The same allocations as the generated module's forward (strides included).
        return _output_like(q, v), q.new_empty(q.shape[:3], dtype=torch.float32)

    def backward_fake(kernel, q, k, v, out, lse, dout, dlse, inputs, *options):
        return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
                [inputs[i].new_empty(inputs[i].shape) for i in learnable])

    torch.library.register_fake(f"attncc::{name}", forward_fake, lib=_LIBRARY)
    torch.library.register_fake(f"attncc::{name}_bwd", backward_fake, lib=_LIBRARY)

    class Attention(torch.autograd.Function):
        """The autograd formula: the forward op below autograd, the backward op for the
        gradients. Inputs are splatted (autograd tracks tensors, not lists of them); the
        call's options come as their record, one argument whatever fields it has.
        `layout` "bshd" (eager calls only): q, k, v come as the caller holds them, and
        their (batch, heads, seq, dim) views are made here, where autograd records
        nothing, their gradients turned back likewise: three view nodes fewer for the
        backward to run than views made by the caller (host time)."""

        @staticmethod
        def forward(ctx, kernel, q, k, v, call, layout, *values):
            q, k, v = (as_bhsd(t, layout) for t in (q, k, v))
            ctx.layout = layout
            if _eager(q):  # the implementation itself: one dispatcher trip fewer
                out, lse = forward_impl(kernel, q, k, v, values, *call.op_arguments())
            else:  # traced (AOTAutograd): the op, a node of the graph
                with torch._C._AutoDispatchBelowAutograd():
                    out, lse = forward(kernel, q, k, v, list(values), *call.op_arguments())
            ctx.save_for_backward(q, k, v, out, lse, *values)
            # The LSE is differentiable, as the reference's: a gradient that does not flow
            # comes as None (not a tensor of zeros), so a call whose LSE no loss reads
            # runs the backward it ran before, with nothing more read.
            ctx.set_materialize_grads(False)
            ctx.call = (kernel, call)
            # The registries are weak: the graph keeps the kernel and tables it needs, as
            # in `attncc.compile(spec)(q, k, v).sum().backward()`.
            ctx.keep_alive = (_kernel(kernel), _tables(call.tables))
            return out, lse

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, dout, dlse):
            q, k, v, out, lse, *values = ctx.saved_tensors
            kernel, call = ctx.call
            if dout is None and dlse is None:
                return (None,) * (6 + len(values))
            if dout is None:  # a loss of the LSE alone
                dout = torch.zeros_like(out)
            if dlse is not None:
                dlse = dlse.contiguous()  # the kernels read it as [B * H, len_q] rows
            # Eager: the implementation itself, as the forward; traced: the op.
            run = backward_impl if _eager(q) else backward
            dq, dk, dv, dlearnable = run(kernel, q, k, v, out, lse, dout, dlse, values,
                                         *call.op_arguments())
            dinputs = [None] * len(values)
            for i, g in zip(learnable, dlearnable):
                dinputs[i] = g
            layout = ctx.layout
            return (None, *(as_bhsd(g, layout) for g in (dq, dk, dv)), None, None, *dinputs)

    def autograd_kernel(kernel, q, k, v, inputs, *options, layout=None):
        # `layout`: eager calls' (the dispatcher passes none): see Attention.
        if torch.is_grad_enabled() and torch._C._any_requires_grad(q, k, v, *inputs):
            return Attention.apply(kernel, q, k, v, record(*options), layout, *inputs)
        q, k, v = (as_bhsd(t, layout) for t in (q, k, v))
        if _eager(q):  # no graph to record: the implementation itself
            return forward_impl(kernel, q, k, v, inputs, *options)
        with torch._C._AutoDispatchBelowAutograd():
            return forward(kernel, q, k, v, inputs, *options)

    _LIBRARY.impl(name, autograd_kernel, "Autograd")
    return Operators(forward, backward, autograd_kernel)


def _eager(q) -> bool:
    """Whether the autograd formula runs on real tensors outside any tracing: then it calls
    the ops' implementations directly, skipping a trip through the dispatcher (its
    argument parsing and boxing, ~10-20 us a direction on a slow CPU). Anything else
    (FakeTensors and the proxy mode of AOTAutograd's tracing, a TorchDispatchMode, a
    tensor subclass) goes through the ops, so that a graph holds them as nodes."""
    return (type(q) is torch.Tensor and not torch._C._len_torch_dispatch_stack()
            and not torch.compiler.is_compiling())


def _table_store(tables):
    """Where a launch finds its tile tables: kept tables' store; else None, the generated
    module's cache of recent calls; or, with ATTNCC_TABLE_CACHE=0, a store of this launch's
    own (built once, shared by its tuning runs)."""
    if tables is not None:
        return tables.store
    return None if settings.TABLE_CACHE == "1" else {}


class _Received(NamedTuple):
    """What an op implementation works from: the kernel, its inputs by name, the call's
    Problem and kept tables, the launch keywords of the call's record, and whether its
    backward must be deterministic."""
    kernel: object
    values: dict
    problem: Problem
    tables: object
    launch: dict
    deterministic: bool


def _received(kernel_id, q, k, v, inputs, options) -> _Received:
    kernel = _kernel(kernel_id)
    call = CallOptions.received(options)
    tables = _tables(call.tables)
    return _Received(kernel, dict(zip(kernel.input_names, inputs)),
                     _problem(q, k, v, call.q_offset, call.k_offset), tables,
                     call.launch_arguments(_table_store(tables)), call.deterministic)


def _forward(kernel_id, q, k, v, inputs, *options):
    precompile.wait_for_triton()
    kernel, values, p, tables, launch, _ = _received(kernel_id, q, k, v, inputs, options)
    if empty_problem(p):
        if tables is not None:
            tables.check_reads(values)
        out, lse = _empty_forward(q, v)
        if kernel.variant.sink is not None:
            lse = sinks.row_sinks(kernel.variant, p, values, lse)  # no key: L = σ
        return out, lse
    return scheduling.forward(kernel, p, q, k, v, values, tables, **launch)


def empty_problem(p: Problem) -> bool:
    """Whether a call has nothing to compute: no batch row, no query or no key. It still
    goes through the operators, so that its output is part of the autograd graph (an
    empty micro-batch's backward runs, giving zero gradients), as SDPA's is."""
    return p.batch == 0 or p.len_q == 0 or p.len_k == 0


def _output_like(q, v):
    """The output as the generated forward allocates it: like q (its strides too) where v
    is as wide as q, else (B, H, Lq, v's head dim), contiguous."""
    if v.shape[-1] == q.shape[-1]:
        return torch.empty_like(q)
    return q.new_empty((*q.shape[:3], v.shape[-1]))


def _empty_forward(q, v):
    """An empty call's output and LSE: rows that see no key give 0 and LSE -inf, allocated
    as the generated forward allocates them (the fake implementation's shapes and strides)."""
    return _output_like(q, v).zero_(), torch.full(q.shape[:3], float("-inf"), device=q.device,
                                           dtype=torch.float32)


def _backward(kernel_id, q, k, v, out, lse, dout, dlse, inputs, *options):
    """The gradients of the output and, with dlse (None when no loss reads the LSE), of
    the LSE (runtime/scheduling.py)."""
    kernel, values, p, tables, launch, deterministic = _received(kernel_id, q, k, v, inputs,
                                                                  options)
    if empty_problem(p):
        # No query sees a key: the output is 0 and the LSE -inf whatever q, k, v and the
        # inputs hold, so every gradient is 0 (dlse included); with a sink, L = σ, whose
        # inputs take dlse (delta = δ - dLSE with δ = 0).
        dinputs = {d.name: values[d.name].new_zeros(values[d.name].shape)
                   for d in kernel.variant.learnable_inputs}
        if kernel.variant.sink is not None and dlse is not None and dlse.numel():
            dinputs = sinks.add_sink_gradients(kernel.variant, p, values, lse, -dlse, dinputs)
        return (q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape),
                [dinputs[d.name] for d in kernel.variant.learnable_inputs])
    return scheduling.backward(kernel, p, q, k, v, out, lse, dout, dlse, values, tables,
                               deterministic, **launch)


# ---------------------------------------------------------------------------- decoding
# kernel.decode is an op of its own per variant, `torch.ops.attncc.<name>_<key>_<revision>_decode`,
# so that a compiled generation loop traces a decode step as one node (Dynamo cannot
# trace into Triton's launch path or the tuner). The call checks run before it, in
# Python (at trace time on FakeTensors; they read no tensor values). It writes the new
# tokens into the caches in place, as its schema says (a!, b!), so functionalization
# keeps the write. Inference only: its Autograd kernel runs it below autograd, with no
# graph. Its options are a DecodeOptions record (attncc/runtime/decoding.py), spelt
# field by field after the tensors, as the attention ops spell their CallOptions.
DECODE_SCHEMA = ("(int kernel, Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, "
                 "Tensor cache_seqlens, Tensor? k_new, Tensor? v_new, Tensor? block_table, "
                 f"Tensor[] inputs, {DecodeOptions.schema_arguments()}) -> (Tensor, Tensor)")
_DECODE_OPS: dict = {}  # op name -> the decode OpOverload


def decode_operator(kernel) -> torch._ops.OpOverload:
    """The decode op of the kernel's variant, defined on first use."""
    name = op_name(kernel.variant) + "_decode"
    if name not in _DECODE_OPS:
        _LIBRARY.define(name + DECODE_SCHEMA)
        op = getattr(torch.ops.attncc, name).default
        _LIBRARY.impl(name, _decode, "CompositeExplicitAutograd")

        def decode_fake(kernel, q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table,
                        inputs, *options):
            # The generated module's allocations: dense, in q's dtype; LSE in float32.
            return (q.new_empty((*q.shape[:3], v_cache.shape[-1])),
                    q.new_empty(q.shape[:3], dtype=torch.float32))

        def decode_autograd(*args):
            with torch._C._AutoDispatchBelowAutograd():
                return op(*args)

        torch.library.register_fake(f"attncc::{name}", decode_fake, lib=_LIBRARY)
        _LIBRARY.impl(name, decode_autograd, "Autograd")
        _DECODE_OPS[name] = op
    return _DECODE_OPS[name]


def _decode(kernel_id, q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, inputs,
            *options):
    kernel = _kernel(kernel_id)
    values = dict(zip(kernel.input_names, inputs))
    return run_decode(kernel, q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table,
                      values, **DecodeOptions(*options).run_arguments())
