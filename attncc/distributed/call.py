"""context_parallel_attention: the call, checked on each rank and agreed on by all
(attncc/distributed)."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .. import ir
from ..arguments import check_return_lse, check_seed, refuse_seed_without_dropout
from ..errors import CallError
from ..runtime.call_options import CallOptions
from .agreement import Signature, agree
from .ring import _ContextParallelAttention, _RingAttention
from .schedule import make_schedule
from .sharding import Sharding


def context_parallel_attention(kernel, q, k, v, /, *, group=None, scheme: str = "zigzag",
                               return_lse: bool = False, dropout_seed: int | None = None,
                               training: bool = True, **inputs):
    """Attention of `kernel` over a sequence sharded across `group` (default: the world).

    q, k, v: this rank's shard, (batch, heads, local length, dim), its pieces in the
    order `Sharding(scheme, ...)` gives (`Sharding.shard` cuts them from a whole
    tensor); every rank's shard has the same length. Returns this rank's shard of the
    output (and of the LSE with return_lse=True); differentiable in q, k, v and
    learnable inputs, through the output and the merged LSE alike. The result equals
    the kernel on the whole sequence. Inputs on position axes are passed whole; every
    input is the same on every rank; the gradient of a learnable input is this rank's
    share (sum it over the group, as for any replicated parameter). With dropout,
    `dropout_seed` is required, the same on every rank. One small all-gather checks all
    of this before any transfer (`agree`): a call refused on one rank is refused on
    every rank.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise CallError("torch.distributed is not initialised: call "
                        "torch.distributed.init_process_group first (backend 'nccl' on "
                        "GPUs, 'gloo' on the CPU)")
    try:
        prepared, refusal = _prepare(kernel, q, k, v, group, scheme, dropout_seed, training,
                                     inputs), None
        check_return_lse(prepared[0].variant, return_lse)
    except CallError as e:
        prepared, refusal = None, e
    if dist.get_rank(group) < 0:  # no rank of the group waits for this process
        raise CallError("this process is not a member of the group it passes; call with a "
                        "group it belongs to")
    agree(Signature.of(kernel, q, k, v, scheme, dropout_seed, training, inputs,
                       refused=refusal is not None), refusal, group,
          device=q.device if isinstance(q, torch.Tensor) else None)
    kernel, sharding, problem = prepared
    sink_variant = kernel.variant if kernel.variant.sink is not None else None
    if sink_variant is not None:
        kernel = _without_sink(kernel)
    schedule = make_schedule(kernel, sharding, problem, inputs, q.device)
    variant = kernel.variant
    names = [d.name for d in variant.inputs]
    values = [inputs[n].contiguous() if variant.input(n).learnable else inputs[n] for n in names]
    call = _RingAttention(kernel, schedule, group, CallOptions(seed=int(dropout_seed or 0)),
                          names, problem, sink_variant)
    out, lse = _ContextParallelAttention.apply(call, q, k, v, *values)
    return (out, lse) if return_lse else out


def _prepare(kernel, q, k, v, group, scheme, dropout_seed, training, inputs) -> tuple:
    """(kernel, sharding, whole-sequence Problem) of a call, checked on this rank alone;
    raises CallError naming what is wrong (which `agree` then raises on every rank)."""
    from ..runtime.kernel import Kernel
    if not isinstance(kernel, Kernel):
        raise CallError(f"kernel must come from attncc.compile(...), got {type(kernel).__name__}")
    if not isinstance(training, bool):
        raise CallError(f"training must be True or False, got {training!r}")
    refuse_seed_without_dropout(kernel.variant, dropout_seed)  # the variant as declared
    if not training and kernel.variant.dropout:
        kernel = kernel.evaluation_kernel()
    if "tables" in inputs:
        raise CallError("tables= is not taken by context_parallel_attention: it keeps the tile "
                        "tables of each piece pair itself")
    sharding = Sharding.of(group, scheme)
    variant = kernel.variant
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        kernel.check_call(q, k, v, inputs, 0, 0, "bhsd")  # raises the kernel's own message
    if q.shape[2] != k.shape[2]:
        raise CallError(f"q has {q.shape[2]} positions on this rank but k has {k.shape[2]}; "
                        "context parallelism shards one sequence, so q, k and v have the same "
                        "local length")
    if q.shape[2] == 0:
        raise CallError(f"this rank's shard is empty (q, k and v have 0 positions): every rank "
                        f"holds {len(sharding.pieces)} non-empty piece(s) of one length "
                        f"({scheme} sharding over {sharding.world_size} ranks); cut a sequence "
                        f"of at least {sharding.n_pieces} positions with Sharding.shard")
    seq_len = q.shape[2] * sharding.world_size
    c = sharding.piece_len(seq_len)
    if variant.block is not None and c % variant.block:
        raise CallError(f"pieces of {c} positions do not hold whole layout blocks of "
                        f"{variant.block}; use a sequence length that is a multiple of "
                        f"{sharding.n_pieces * variant.block}")
    lengths = {"len_q", "len_k"} & set().union(
        *(ir.free_vars(e) for e in (variant.mask, variant.score, variant.layout, variant.sink,
                                    variant.weight)
          if e is not None))
    if lengths:
        raise CallError(f"variant '{variant.name}' reads {' and '.join(sorted(lengths))}, which "
                        "in each piece's call would be the piece's length, not the sequence's; "
                        "write the sequence length as a param to run it context-parallel")
    if variant.dropout:
        if not isinstance(dropout_seed, int) or isinstance(dropout_seed, bool):
            raise CallError(f"variant '{variant.name}' has dropout: pass dropout_seed=int, the "
                            "same on every rank, so that every rank drops the bits the whole "
                            f"sequence's call would (got {dropout_seed!r})")
        check_seed(dropout_seed)
    # Check the call as the whole sequence: zero-copy views of the global shape carry
    # the dtype, device and head counts; inputs must be whole.
    whole = [t[:, :, :1].expand(t.shape[0], t.shape[1], seq_len, t.shape[3]) for t in (q, k, v)]
    try:
        problem = kernel.check_call(*whole, inputs, 0, 0, "bhsd")
    except CallError as e:
        raise CallError(f"{e} (context_parallel_attention checks the call as the whole sequence "
                        f"of {seq_len} positions: inputs on position axes are passed whole, the "
                        "same on every rank)") from None
    return kernel, sharding, problem


def _without_sink(kernel):
    """The kernel of `kernel`'s variant less its `sink`, which the piece pairs run: the
    sink is one logit per row, merged once after the last hop, not once per pair.
    Compiled on first use and kept with the kernel."""
    from ..runtime.kernel import Kernel
    pieces = getattr(kernel, "_context_parallel_pieces", None)
    if pieces is None:
        pieces = Kernel(dataclasses.replace(kernel.variant, sink=None),
                        backend=kernel.requested_backend)
        kernel._context_parallel_pieces = pieces
    return pieces
