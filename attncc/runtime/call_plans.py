"""Launch plans for the training forward and backward: a call like an earlier one runs
the earlier call's choices and relaunches its compiled kernels.

The first call of a kind does what it always did: the kernel roles (runtime/dispatch.py:
which backends can take these tensors), the tuner's choice of backend and tile config
(runtime/tuning.py: tuning, or the choice it remembers), compiling, and Triton's JIT
binding every argument on every launch. All of that depends on the call's `plan key`
alone, so once the call has run, its choices are kept in a plan; a later call with the
same key calls the chosen entry points of the generated modules at once, with a
`Launches` as their launcher, which relaunches each compiled kernel directly
(runtime/launch.py). On an H200 that host work was most of a call at short and windowed
shapes (benchmarks/host_overhead.py measures it).

The key holds everything the roles, the choice and Triton's specialization read: each
tensor's type, shape, strides, dtype, device and 16-byte alignment (Triton specializes
pointers on it; integer arguments on equal to 1 and divisible by 16, and the integers a
launch takes are shapes, strides and offsets, which the key holds), the inputs' names,
the offsets, where the tile tables come from (the module's cache, a store of the call's
own, or kept tables by their density bucket), whether q, k or v take gradients (a first
forward that does compiles the backward beside it), the current CUDA device, and the
settings read at each call (ATTNCC_TUNE, ATTNCC_CONFIG, whether the interpreter runs). The dropout
seed changes every call and the kernels do not specialize on it; the tensors a launch
allocates come from PyTorch's allocator, aligned. Anything a plan still could not match
(a launch whose grid or constexprs differ from the kept one's) gets a Launch of its own.

A plan copies the tuner's choice, so it lasts as long as the tuner remembers it: it keeps
the entries of the tuner's memory that held its choices and is dropped when one is gone
(a test or a tool clearing the memory to tune again tunes again).
"""
from __future__ import annotations

import os

import torch

from .. import backends
from . import settings, tuning
from .configs import density_bucket

MAX_PLANS = 64  # per kernel: a model trains with a handful of shapes


class Launches:
    """The launcher of a plan's entry points (the generated modules' `_via`): each kernel
    through a Launch of its own, made on the plan's first run (where the JIT binds the
    arguments and finds the compiled kernel) and relaunched directly after.

    Under the interpreter a plan is used and every launch of it takes the interpreter's
    own path: the interpreter returns no compiled kernel, so each Launch calls
    kernel[grid] as the entry point would (runtime/launch.py). The plan still skips the
    roles and the tuner, and the CPU tests run the same plan code as the GPU does; a plan
    key holds whether the interpreter runs, so no plan crosses between the two."""
    __slots__ = ("kept",)

    def __init__(self):
        self.kept = {}  # (id of the kernel, grid) -> Launch; the Launch keeps the kernel alive

    def __call__(self, kernel, grid):
        return lambda *args, **options: self._launch(kernel, grid, args, options)

    def _launch(self, kernel, grid, args, options):
        key = (id(kernel), grid)
        run = self.kept.get(key)
        if run is None or run.kernel is not kernel or run.options != options:
            # Imported here, not with this module: runtime/launch.py imports triton, and
            # a triton imported before `attncc check` sets TRITON_INTERPRET keeps its own
            # JIT functions (tl.cdiv) compiled, which the interpreter cannot call
            # (runtime/eager.py; kernel.decode's plans import it so too).
            from .launch import Launch
            run = self.kept[key] = Launch(kernel, grid, options)
        run(*args)


class Step:
    """One kernel role of a plan: the backend that runs it (and why), its tile config, and
    what a relaunch calls: the backend's module, whose entry point of the role it looks
    up at each call (as the first call did: a module function replaced since is the one
    called), and the config as the generated modules take it (a dict, built once)."""
    __slots__ = ("backend", "config", "ran", "module", "direction", "arguments")

    def __init__(self, kernel, direction: str, config):
        ran = kernel.last_backend if direction == "fwd" else kernel.last_backward[direction]
        self.backend = backends.named(ran[0])
        self.config = config
        self.ran = ran
        self.module = kernel.module_of(self.backend.name)
        self.direction = direction
        self.arguments = config.as_dict()

    def entry(self, *args, **kwargs):
        """The role's entry point, called with the plan's config."""
        return self.backend.entry(self.module, self.direction)(*args, config=self.arguments,
                                                               **kwargs)


class Plan:
    """The steps of one call of a kind (forward: "fwd"; backward: "dq", "dkdv", or "bwd",
    a table-driven variant's one launch), their launches, and the tuner's memory entries
    their choices came from."""
    __slots__ = ("steps", "launches", "needs")

    def __init__(self, kernel, steps: dict):
        self.steps = steps
        self.launches = Launches()
        configs = [s.config for s in steps.values()]
        self.needs = tuple((key, choice) for key, choice in tuning._MEMORY.items()
                           if key[0] == kernel.key and any(
                               choice is c or getattr(choice, "config", None) is c
                               for c in configs))

    def fresh(self) -> bool:
        """Whether the tuner still remembers the choices this plan copied."""
        memory = tuning._MEMORY
        return all(memory.get(key) is choice for key, choice in self.needs)


def forward(kernel, plan: Plan, q, k, v, values: dict, common: dict):
    """(out, lse) of a call through its forward plan."""
    step = plan.steps["fwd"]
    kernel.record_choice("fwd", step.ran)
    return step.entry(q, k, v, values, launcher=plan.launches, **common)


def backward(kernel, plan: Plan, q, k, v, out, lse, dout, dlse, values: dict, common: dict):
    """(dq, dk, dv, dinputs, delta) of a call through its backward plan: dQ (computing
    delta), then dK/dV, as runtime/scheduling.py's _dq_then_dkdv launches them."""
    delta = kernel.module.new_delta(q)
    dq_step, dkdv_step = plan.steps["dq"], plan.steps["dkdv"]
    kernel.record_choice("dq", dq_step.ran)
    kernel.record_choice("dkdv", dkdv_step.ran)
    # The entry points as Kernel.backward_run calls them, with the plan's launcher.
    dq, dinputs = dq_step.entry(q, k, v, lse, delta, dout, values, launcher=plan.launches,
                                out=out, dlse=dlse, **common)
    dk, dv, *by_keys = dkdv_step.entry(q, k, v, lse, delta, dout, values,
                                       launcher=plan.launches, **common)
    if by_keys:  # learnable reads of keys alone, whose gradients the dK/dV programs own
        dinputs = {name: g + by_keys[0][name] for name, g in dinputs.items()}
    return dq, dk, dv, dinputs, delta


def one_launch_backward(kernel, plan: Plan, q, k, v, out, lse, dout, dlse, values: dict,
                        common: dict):
    """(dq, dk, dv, dinputs, delta) of a table-driven call through its one-launch plan:
    the delta pass (from `out`, the forward's output; None where the variant reads no
    delta), then dK/dV and dQ in one launch, as runtime/scheduling.py's first call."""
    module = kernel.module
    step = plan.steps["bwd"]
    kernel.record_choice("bwd", step.ran)
    if out is not None:
        delta = module.backward_delta(out, dout, lse=lse, dlse=dlse, launcher=plan.launches)
    else:
        delta = module.new_delta(q)
    dq, dk, dv, dinputs = step.entry(q, k, v, lse, delta, dout, values,
                                     launcher=plan.launches, **common)
    return dq, dk, dv, dinputs, delta


# ---------------------------------------------------------------------------- keys
def _tensor_key(t) -> tuple:
    """A tensor's part of a plan key; TypeError for anything that is not a tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError
    return type(t), t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0


def _call_key(q, values: dict, common: dict, kept_tables) -> tuple:
    """What the tensors' keys leave out: the inputs, the options, the tables, the device
    and the settings."""
    tables = common.get("tables")
    return (tuple([(name, _tensor_key(t)) for name, t in values.items()]),
            common.get("q_offset"), common.get("k_offset"),
            # Kept tables tune per density bucket; else the module's cache (None) or a
            # store of this call's own (ATTNCC_TABLE_CACHE=0).
            density_bucket(kept_tables.density) if kept_tables is not None else tables is None,
            torch.cuda.current_device() if q.is_cuda else None,
            os.environ.get("ATTNCC_TUNE"), os.environ.get("ATTNCC_CONFIG"),
            settings.interpreting())


def forward_key(q, k, v, values: dict, common: dict, kept_tables) -> tuple | None:
    """A forward call's plan key; None where the call holds a non-tensor (no plan)."""
    try:
        return ("fwd", _tensor_key(q), _tensor_key(k), _tensor_key(v),
                q.requires_grad or k.requires_grad or v.requires_grad,
                _call_key(q, values, common, kept_tables))
    except (TypeError, AttributeError):
        return None


def backward_key(q, k, v, out, lse, dout, dlse, values: dict, common: dict,
                 kept_tables, schedule) -> tuple | None:
    """A backward call's plan key; None where the call holds a non-tensor (no plan).
    `schedule`: a table-driven variant's ATTNCC_BACKWARD (settings.TABLES_BACKWARD, which
    a test or a tool may switch in-process), else None."""
    try:
        return ("bwd", schedule, *(_tensor_key(t) for t in (q, k, v, out, lse, dout)),
                None if dlse is None else _tensor_key(dlse),
                _call_key(q, values, common, kept_tables))
    except (TypeError, AttributeError):
        return None


def find(kernel, key) -> Plan | None:
    """The kernel's plan for `key`, if it has one the tuner still backs."""
    if key is None:
        return None
    plan = kernel._call_plans.get(key)
    if plan is not None and not plan.fresh():
        kernel._call_plans.pop(key, None)
        return None
    return plan


def keep(kernel, key, plan: Plan) -> None:
    if key is None:
        return
    plans = kernel._call_plans
    if len(plans) >= MAX_PLANS:
        plans.pop(next(iter(plans), None), None)  # the oldest (another thread may drop it too)
    plans[key] = plan
