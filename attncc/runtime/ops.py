"""PyTorch operators for compiled variants: a torch.library custom op per variant.

`Kernel.__call__` checks a call in Python and then calls the variant's forward op,
`torch.ops.attncc.<name>_<key>_<revision>` (`op_name`); its autograd kernel (an
autograd.Function) calls the backward op, `..._bwd`. Each op has a real implementation (the
generated module's launches, tuning included) and a fake one (empty outputs of the right
shapes and strides), so torch.compile traces a call as one opaque node, with symbolic
sequence lengths, and never traces into Triton's launch path, the tuner or the table
caches; and since the backward is an op too, AOTAutograd traces it the same way.

What crosses the op boundary, and how:
- q, k, v and the variant's inputs (a Tensor[] in declared order); q_offset, k_offset
  and a dropout_seed given by the caller as SymInts (dynamic under torch.compile, not
  baked in). A seed the call draws itself is a one-element CPU int64 tensor from torch's
  generator (`drawn_seed`), so that a compiled graph draws a fresh one on every run.
- The backward takes the LSE's gradient as an optional tensor, `dlse`: None when no
  loss reads the LSE (autograd's grads are not materialised), so that case reads no
  tensor of zeros and launches what it did before the LSE was differentiable.
- The Kernel and its kept TileTables as int ids into process-wide registries (weak: an
  id outlives nothing). Tables are not tensors to hand over: the generated module builds
  them lazily per tile size, and the tile size is picked inside the op by the tuner; the
  tensors they are built from already pass through. An id is a constant in a traced
  graph, so another TileTables object is another graph (Dynamo guards on the object).
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

from . import precompile, scheduling
from ..arguments import Problem, check_seed
from ..errors import CallError
from ..version import __version__

_KERNELS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_TABLES: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_IDS = itertools.count(1)  # never reused, so a stale id finds nothing rather than another object
_OPS: dict = {}  # op name -> Operators; defined once per process and variant
NO_TABLES = 0


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
    """A short hash of what a compiled graph assumes about the ops: their schemas and this
    module's autograd and op code. torch.compile's caches (AOTAutograd's and Inductor's,
    on disk, shared by every process of the user) store traced graphs that call the ops by
    name; an attncc whose `_bwd` op took one argument more, under the same name, would be
    called by a stale cached backward with the old argument list (seen when the LSE became
    differentiable). Naming the revision makes such a graph miss the cache instead."""
    import hashlib
    text = "\n".join((FORWARD_SCHEMA, BACKWARD_SCHEMA, DECODE_SCHEMA, __version__,
                      Path(__file__).read_text()))
    return hashlib.sha256(text.encode()).hexdigest()[:8]


class Operators(NamedTuple):
    forward: torch._ops.OpOverload  # torch.ops.attncc.<op_name>.default
    backward: torch._ops.OpOverload  # torch.ops.attncc.<op_name>_bwd.default
    # The forward op's autograd kernel, for eager calls to enter directly: with the same
    # arguments and results as `forward`, one trip through the dispatcher fewer (~20 us
    # of host time on a slow CPU). Its forward calls the forward op, so the kernels run
    # in the op's implementation either way.
    apply: Callable


def operators(kernel) -> Operators:
    """The ops of the kernel's variant, defined on first use."""
    name = op_name(kernel.variant)
    if name not in _OPS:
        _OPS[name] = _define(name, kernel.variant)
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


def _seed(seed: int, drawn_seed) -> int:
    # A seed drawn by the call (no dropout_seed given) is a CPU tensor, so that under
    # torch.compile it is drawn on every run, in the graph; reading it syncs nothing. A
    # given seed is checked here too: a traced call could not read its value.
    return check_seed(seed) if drawn_seed is None else int(drawn_seed)


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

FORWARD_SCHEMA = ("(int kernel, Tensor q, Tensor k, Tensor v, Tensor[] inputs, SymInt q_offset, "
                  "SymInt k_offset, SymInt seed, Tensor? drawn_seed, int tables) -> (Tensor, Tensor)")
BACKWARD_SCHEMA = ("(int kernel, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor dout, "
                   "Tensor? dlse, Tensor[] inputs, SymInt q_offset, SymInt k_offset, SymInt seed, "
                   "Tensor? drawn_seed, int tables) -> (Tensor, Tensor, Tensor, Tensor[])")


def _define(name: str, variant):
    learnable = [i for i, d in enumerate(variant.inputs) if d.learnable]
    _LIBRARY.define(name + FORWARD_SCHEMA)
    _LIBRARY.define(name + "_bwd" + BACKWARD_SCHEMA)
    forward = getattr(torch.ops.attncc, name).default
    backward = getattr(torch.ops.attncc, name + "_bwd").default
    # The real implementations serve every device (the kernels take CUDA tensors, and
    # CPU ones under the interpreter); the fake ones, FakeTensors (torch.compile).
    _LIBRARY.impl(name, _forward, "CompositeExplicitAutograd")
    _LIBRARY.impl(name + "_bwd", _backward, "CompositeExplicitAutograd")

    def forward_fake(kernel, q, k, v, inputs, q_offset, k_offset, seed, drawn_seed, tables):
        # The same allocations as the generated module's forward (strides included).
        return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)

    def backward_fake(kernel, q, k, v, out, lse, dout, dlse, inputs, q_offset, k_offset, seed,
                      drawn_seed, tables):
        return (q.new_empty(q.shape), k.new_empty(k.shape), k.new_empty(k.shape),
                [inputs[i].new_empty(inputs[i].shape) for i in learnable])

    torch.library.register_fake(f"attncc::{name}", forward_fake, lib=_LIBRARY)
    torch.library.register_fake(f"attncc::{name}_bwd", backward_fake, lib=_LIBRARY)

    class Attention(torch.autograd.Function):
        """The autograd formula: the forward op below autograd, the backward op for the
        gradients. Inputs are splatted (autograd tracks tensors, not lists of them)."""

        @staticmethod
        def forward(ctx, kernel, q, k, v, q_offset, k_offset, seed, drawn_seed, tables, *values):
            with torch._C._AutoDispatchBelowAutograd():
                out, lse = forward(kernel, q, k, v, list(values), q_offset, k_offset, seed,
                                   drawn_seed, tables)
            ctx.save_for_backward(q, k, v, out, lse, *values)
            # The LSE is differentiable, as the reference's: a gradient that does not flow
            # comes as None (not a tensor of zeros), so a call whose LSE no loss reads
            # runs the backward it ran before, with nothing more read.
            ctx.set_materialize_grads(False)
            ctx.call = (kernel, q_offset, k_offset, seed, drawn_seed, tables)
            # The registries are weak: the graph keeps the kernel and tables it needs, as
            # in `attncc.compile(spec)(q, k, v).sum().backward()`.
            ctx.keep_alive = (_kernel(kernel), _tables(tables))
            return out, lse

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, dout, dlse):
            q, k, v, out, lse, *values = ctx.saved_tensors
            kernel, q_offset, k_offset, seed, drawn_seed, tables = ctx.call
            if dout is None and dlse is None:
                return (None,) * (9 + len(values))
            if dout is None:  # a loss of the LSE alone
                dout = torch.zeros_like(out)
            if dlse is not None:
                dlse = dlse.contiguous()  # the kernels read it as [B * H, len_q] rows
            dq, dk, dv, dlearnable = backward(kernel, q, k, v, out, lse, dout, dlse, values,
                                              q_offset, k_offset, seed, drawn_seed, tables)
            dinputs = [None] * len(values)
            for i, g in zip(learnable, dlearnable):
                dinputs[i] = g
            return None, dq, dk, dv, None, None, None, None, None, *dinputs

    def autograd_kernel(kernel, q, k, v, inputs, q_offset, k_offset, seed, drawn_seed, tables):
        if torch.is_grad_enabled() and torch._C._any_requires_grad(q, k, v, *inputs):
            return Attention.apply(kernel, q, k, v, q_offset, k_offset, seed, drawn_seed,
                                   tables, *inputs)
        with torch._C._AutoDispatchBelowAutograd():
            return forward(kernel, q, k, v, inputs, q_offset, k_offset, seed, drawn_seed, tables)

    _LIBRARY.impl(name, autograd_kernel, "Autograd")
    return Operators(forward, backward, autograd_kernel)


def _table_store(tables):
    """Where a launch finds its tile tables: kept tables' store; else None, the generated
    module's cache of recent calls; or, with ATTNCC_TABLE_CACHE=0, a store of this launch's
    own (built once, shared by its tuning runs)."""
    from .settings import TABLE_CACHE
    if tables is not None:
        return tables.store
    return None if TABLE_CACHE == "1" else {}


def _forward(kernel_id, q, k, v, inputs, q_offset, k_offset, seed, drawn_seed, tables_id):
    precompile.wait_for_triton()
    kernel = _kernel(kernel_id)
    seed = _seed(seed, drawn_seed)
    tables = _tables(tables_id)
    values = dict(zip(kernel.input_names, inputs))
    p = _problem(q, k, v, q_offset, k_offset)
    if empty_problem(p):
        if tables is not None:
            tables.check_reads(values)
        return _empty_forward(q)
    return scheduling.forward(kernel, p, q, k, v, values, tables, q_offset=q_offset,
                              k_offset=k_offset, seed=seed, tables=_table_store(tables))


def empty_problem(p: Problem) -> bool:
    """Whether a call has nothing to compute: no batch row, no query or no key. It still
    goes through the operators, so that its output is part of the autograd graph (an
    empty micro-batch's backward runs, giving zero gradients), as SDPA's is."""
    return p.batch == 0 or p.len_q == 0 or p.len_k == 0


def _empty_forward(q):
    """An empty call's output and LSE: rows that see no key give 0 and LSE -inf, allocated
    as the generated forward allocates them (the fake implementation's shapes and strides)."""
    return torch.zeros_like(q), torch.full(q.shape[:3], float("-inf"), device=q.device,
                                           dtype=torch.float32)


def _backward(kernel_id, q, k, v, out, lse, dout, dlse, inputs, q_offset, k_offset, seed,
              drawn_seed, tables_id):
    """The gradients of the output and, with dlse (None when no loss reads the LSE), of
    the LSE (runtime/scheduling.py)."""
    kernel = _kernel(kernel_id)
    seed = _seed(seed, drawn_seed)
    tables = _tables(tables_id)
    values = dict(zip(kernel.input_names, inputs))
    p = _problem(q, k, v, q_offset, k_offset)
    if empty_problem(p):
        # No query sees a key: the output is 0 and the LSE -inf whatever q, k, v and the
        # inputs hold, so every gradient is 0 (dlse included).
        return (q.new_zeros(q.shape), k.new_zeros(k.shape), v.new_zeros(v.shape),
                [values[d.name].new_zeros(values[d.name].shape)
                 for d in kernel.variant.learnable_inputs])
    return scheduling.backward(kernel, p, q, k, v, out, lse, dout, dlse, values, tables,
                               q_offset=q_offset, k_offset=k_offset, seed=seed,
                               tables=_table_store(tables))


# ---------------------------------------------------------------------------- decoding
# kernel.decode is an op of its own per variant, `torch.ops.attncc.<name>_<key>_<revision>_decode`,
# so that a compiled generation loop traces a decode step as one node (Dynamo cannot
# trace into Triton's launch path or the tuner). The call checks run before it, in
# Python (at trace time on FakeTensors; they read no tensor values). It writes the new
# tokens into the caches in place, as its schema says (a!, b!), so functionalization
# keeps the write. Inference only: its Autograd kernel runs it below autograd, with no
# graph. `config` is [] or the four CONFIG_KEYS values in order; `num_splits` 0 is unset.
DECODE_SCHEMA = ("(int kernel, Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, "
                 "Tensor cache_seqlens, Tensor? k_new, Tensor? v_new, Tensor? block_table, "
                 "Tensor[] inputs, int num_splits, int[] config, bool rows_before_start) "
                 "-> (Tensor, Tensor)")
_DECODE_OPS: dict = {}  # op name -> the decode OpOverload


def decode_operator(kernel) -> torch._ops.OpOverload:
    """The decode op of the kernel's variant, defined on first use."""
    name = op_name(kernel.variant) + "_decode"
    if name not in _DECODE_OPS:
        _LIBRARY.define(name + DECODE_SCHEMA)
        op = getattr(torch.ops.attncc, name).default
        _LIBRARY.impl(name, _decode, "CompositeExplicitAutograd")

        def decode_fake(kernel, q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table,
                        inputs, num_splits, config, rows_before_start):
            # The generated module's allocations: dense, in q's dtype; LSE in float32.
            return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)

        def decode_autograd(*args):
            with torch._C._AutoDispatchBelowAutograd():
                return op(*args)

        torch.library.register_fake(f"attncc::{name}", decode_fake, lib=_LIBRARY)
        _LIBRARY.impl(name, decode_autograd, "Autograd")
        _DECODE_OPS[name] = op
    return _DECODE_OPS[name]


def _decode(kernel_id, q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, inputs,
            num_splits, config, rows_before_start):
    from .decoding import CONFIG_KEYS, run_decode
    kernel = _kernel(kernel_id)
    values = dict(zip(kernel.input_names, inputs))
    return run_decode(kernel, q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table,
                      values, num_splits=num_splits or None,
                      config=dict(zip(CONFIG_KEYS, config)) if config else None,
                      rows_before_start=rows_before_start)
