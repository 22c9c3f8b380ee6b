"""What runs for one call of a variant's operator, and in what order: the forward's and
the backward's kernel roles, each launched on the backend and tile config the tuner
chose (runtime/dispatch.py, runtime/tuning.py), and the first compiles started together.

runtime/ops.py's operators decode their arguments (the kernel and kept tables from their
ids, the seed) and call `forward` and `backward` here; everything below reaches the
Kernel through its public methods.
"""
from __future__ import annotations

import warnings

import torch

from .. import backends, ir
from ..backends.base import FUSED
from . import call_plans, precompile, settings, sinks, tuning


def forward(kernel, problem, q, k, v, values: dict, kept_tables, **common):
    """(out, lse) of a non-empty call of `kernel` shaped as `problem`. `kept_tables`: the
    TileTables passed as tables= (None without); `common`: the launches' keyword arguments
    (q_offset, k_offset, seed, and tables: where a launch finds its tile tables)."""
    # The checks that read tensor data (runtime/ops.py's docstring says why they are here).
    # Kept tables' lists were checked when they were built, and check_reads holds them to
    # those tensors: re-checking read them on every call where no version counter tells
    # a write (inference tensors), a host sync kept tables promise not to make.
    if kept_tables is None:
        kernel.check_index_lists(problem, values)
    if kernel.variant.dropout and q.is_cuda and torch.cuda.is_current_stream_capturing():
        warnings.warn(f"attncc: a call of '{kernel.variant.name}' (dropout) is being captured in "
                      "a CUDA graph: the kernels take the dropout seed as a launch argument, so "
                      "every replay drops the same elements", stacklevel=2)
    if kept_tables is not None:
        kept_tables.check_reads(values)
    # A call like an earlier one runs the earlier one's choices (runtime/call_plans.py).
    key = call_plans.forward_key(q, k, v, values, common, kept_tables)
    plan = call_plans.find(kernel, key)
    if plan is not None:
        return call_plans.forward(kernel, plan, q, k, v, values, common)
    tune = kernel.tuning_inputs(problem, values, q.device, kept_tables)
    role = kernel.forward_role(q, k, v, values, common)
    if q.is_cuda and (q.requires_grad or k.requires_grad or v.requires_grad):
        compile_backward_beside(kernel, problem, q, k, v, values, common, tune, role)
    run, config = kernel.choose(role, problem, q.dtype, tune)
    result = tuning.launch(kernel, problem, q.dtype, "fwd", run, config)
    call_plans.keep(kernel, key, call_plans.Plan(kernel, {"fwd": call_plans.Step(kernel, "fwd",
                                                                                 config)}))
    return result


def _untimed(kernel, role, problem, dtype, tune):
    """(run, config, new) where the role's choice needs no timing (tuning.untimed_choice),
    else None."""
    choice, new = tuning.untimed_choice(kernel, problem, dtype, role.direction,
                                        tuple(role.runs), *tune[1:])
    return None if choice is None else (role.runs[choice.backend], choice.config, new)


def compile_backward_beside(kernel, problem, q, k, v, values, common, tune, forward_role):
    """A first forward whose inputs take gradients compiles the backward's kernels at the
    same time as its own (runtime/precompile.py), where every choice is known without
    timing and none was launched yet: the first result then waits for the slowest compile
    instead of their sum. The backward launches run on stand-in tensors (empty lse, delta
    and dO): what they compute is discarded, and nothing they index depends on it. Nothing
    is reported (kernel.last_backward is the latest backward's)."""
    module = kernel.module
    chosen = _untimed(kernel, forward_role, problem, q.dtype, tune)
    if chosen is None or not chosen[2]:
        return
    launches = [lambda run=chosen[0], config=chosen[1]: run(config)]
    out = (torch.empty_like(q) if v.shape[-1] == q.shape[-1]
           else q.new_empty((*q.shape[:3], v.shape[-1])))
    dout = torch.empty_like(out)
    lse = torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
    delta = module.new_delta(q)
    for d in _directions(kernel, q, k, v):
        if d == "bwd":
            role = kernel.one_launch_role(q, k, v, lse, delta, dout, values, common)
        else:  # dQ or dK/dV, on whichever backend is known untimed (as backward launches them)
            role = kernel.backward_role(d, q, k, v, lse, delta, dout, values, common,
                                        out=out if reads_delta(kernel.variant) else None)
        chosen = _untimed(kernel, role, problem, q.dtype, tune)
        if chosen is None or not chosen[2]:
            return  # tuned later, on real tensors; or already compiled
        if d == "bwd" and reads_delta(kernel.variant):
            launches.append(lambda: module.backward_delta(out, dout))
        launches.append(lambda run=chosen[0], config=chosen[1]: run(config))
    precompile.launch_together(launches)


def backward(kernel, problem, q, k, v, out, lse, dout, dlse, values: dict, kept_tables,
             deterministic: bool = True, **common):
    """(dq, dk, dv, dinputs) of a non-empty call: the gradients of the output and, with
    dlse (None when no loss reads the LSE), of the LSE: folded into delta (delta - dlse,
    see the backward template), so the dQ and dK/dV kernels run unchanged. `dinputs`:
    [gradient] of the learnable inputs, in declared order. `deterministic` False (and
    torch.use_deterministic_algorithms off) lets a backend's fused backward run, whose
    dQ is summed by atomic adds in no fixed order; where none takes the call, the
    deterministic kernels run. Other arguments as forward's."""
    module = kernel.module
    kernel.begin_backward()
    if not (deterministic or torch.are_deterministic_algorithms_enabled()):
        fused = kernel.fused_backend(q, k, v)
        if fused is not None:
            return _fused(kernel, fused, problem, q, k, v, out, lse, dout, dlse, values,
                          kept_tables, common)
    # A call like an earlier one runs the earlier one's choices (runtime/call_plans.py),
    # the roles it ran included: the key holds what decides them (the schedule setting and
    # what the backends' call checks read), so they are worked out on a new call alone.
    schedule = settings.TABLES_BACKWARD if module.USES_TABLES else None
    key = call_plans.backward_key(q, k, v, out, lse, dout, dlse, values, common, kept_tables,
                                  schedule)
    plan = call_plans.find(kernel, key)
    one_launch = ("bwd" in plan.steps if plan is not None
                  else _directions(kernel, q, k, v) == ("bwd",))
    if plan is not None:
        # Under `none` neither the delta pass nor the dQ kernel reads O (see _dq_then_dkdv).
        planned = call_plans.one_launch_backward if one_launch else call_plans.backward
        dq, dk, dv, dinputs, delta = planned(
            kernel, plan, q, k, v, out if reads_delta(kernel.variant) else None, lse, dout, dlse,
            values, common)
    elif one_launch:
        tune = kernel.tuning_inputs(problem, values, q.device, kept_tables)
        # dK/dV and dQ as two roles of one grid, one config, both reading delta: the
        # portable module's launch (Kernel.one_launch_role).
        choice, new = tuning.untimed_choice(kernel, problem, q.dtype, "bwd",
                                            (backends.portable().name,), *tune[1:])
        if new:  # its first launch: compile the delta pass beside it (on a stand-in delta)
            scratch = kernel.one_launch_role(q, k, v, lse, module.new_delta(q), dout, values,
                                             common)
            launches = [lambda: scratch.runs[choice.backend](choice.config)]
            if reads_delta(kernel.variant):
                launches.insert(0, lambda: module.backward_delta(out, dout))
            precompile.launch_together(launches)
        delta = (module.backward_delta(out, dout, lse=lse, dlse=dlse) if reads_delta(kernel.variant)
                 else module.new_delta(q))
        role = kernel.one_launch_role(q, k, v, lse, delta, dout, values, common)
        run, config = kernel.choose(role, problem, q.dtype, tune)
        dq, dk, dv, dinputs = tuning.launch(kernel, problem, q.dtype, "bwd", run, config)
        call_plans.keep(kernel, key, call_plans.Plan(kernel, {
            "bwd": call_plans.Step(kernel, "bwd", config)}))
    else:
        tune = kernel.tuning_inputs(problem, values, q.device, kept_tables)
        dq, dk, dv, dinputs, delta, chosen = _dq_then_dkdv(kernel, problem, q, k, v, out, lse,
                                                           dout, dlse, values, common, tune)
        call_plans.keep(kernel, key, call_plans.Plan(kernel, {
            d: call_plans.Step(kernel, d, config) for d, config in chosen.items()}))
    if kernel.variant.sink is not None:
        dinputs = sinks.add_sink_gradients(kernel.variant, problem, values, lse, delta, dinputs)
    return dq, dk, dv, [dinputs[d.name] for d in kernel.variant.learnable_inputs]


def _directions(kernel, q, k, v) -> tuple:
    """The roles this call's backward runs (settings.backward_directions); whether another
    backend takes dQ and dK/dV is asked only where the answer matters."""
    uses_tables = kernel.module.USES_TABLES
    split_preferred = uses_tables and settings.TABLES_BACKWARD == "auto" \
        and kernel.split_preferred(q, k, v)
    return settings.backward_directions(uses_tables, split_preferred)


def _fused(kernel, backend, problem, q, k, v, out, lse, dout, dlse, values, kept_tables,
           common):
    """deterministic=False's backward on `backend` (Kernel.fused_backend's): delta (minus
    dlse) from the portable module's pass, then dK, dV and dQ in one launch. The fused
    kernel takes no variant with learnable inputs, so there are no input gradients (a
    sink's gradient is a learnable input's)."""
    tune = kernel.tuning_inputs(problem, values, q.device, kept_tables)
    delta = kernel.module.backward_delta(out, dout, lse=lse, dlse=dlse)
    role = kernel.fused_role(backend, q, k, v, lse, delta, dout, values, common)
    run, config = kernel.choose(role, problem, q.dtype, tune)
    dq, dk, dv = tuning.launch(kernel, problem, q.dtype, FUSED, run, config)
    return dq, dk, dv, []


def reads_delta(variant) -> bool:
    """Whether the backward reads delta = rowsum(dO * O): softmax's and `sum`'s divide by
    a row's normaliser, whose gradient it is; `none` divides by nothing, so its backward
    skips the pass (or the dQ kernel's share of it) that computes it."""
    return variant.normalize != ir.UNNORMALIZED


def _dq_then_dkdv(kernel, problem, q, k, v, out, lse, dout, dlse, values, common, tune):
    """dQ first, computing delta = rowsum(dO * O) on the way, then dK/dV, which reads it
    (returned after the gradients: a sink's gradient reads it too), and the tile config
    each ran ({"dq": config, "dkdv": config}: a plan keeps them).
    They are tuned apart: they want different tile shapes. Each runs on the backend its
    role chose (kernel.last_backward says which)."""
    module = kernel.module
    delta = module.new_delta(q)
    # Without `out` the dQ kernel reads delta instead of computing it: under `none`,
    # which reads none, it then reads neither O nor delta.
    out = out if reads_delta(kernel.variant) else None
    roles = {kind: kernel.backward_role(kind, q, k, v, lse, delta, dout, values, common,
                                        out=out, dlse=dlse) for kind in ("dq", "dkdv")}
    known = [_untimed(kernel, role, problem, q.dtype, tune) for role in roles.values()]
    if all(c is not None and c[2] for c in known):
        # Choices known without timing and not launched yet: compile both at once (each
        # launch is discarded; dK/dV's reads a delta dQ's has not finished).
        precompile.launch_together([lambda run=c[0], config=c[1]: run(config) for c in known])
    # dQ first: tuning it fills delta, which tuning dK/dV then reads.
    run, config = kernel.choose(roles["dq"], problem, q.dtype, tune)
    dq, dinputs = tuning.launch(kernel, problem, q.dtype, "dq", run, config)
    chosen = {"dq": config}
    run, config = kernel.choose(roles["dkdv"], problem, q.dtype, tune)
    dk, dv, *by_keys = tuning.launch(kernel, problem, q.dtype, "dkdv", run, config)
    chosen["dkdv"] = config
    if by_keys:  # learnable reads of keys alone, whose gradients the dK/dV programs own
        dinputs = {name: g + by_keys[0][name] for name, g in dinputs.items()}
    return dq, dk, dv, dinputs, delta, chosen
