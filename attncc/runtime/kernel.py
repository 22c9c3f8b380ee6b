"""A compiled variant at run time: the Kernel (call checks, backend choice, the call
through its torch.library op) and the tile tables a caller keeps.

`compile_variant` finds or renders the variant's modules (runtime/cache.py). The returned
`Kernel` checks each call (naming the argument, what was given and what is expected) and
calls the variant's operator (runtime/ops.py), whose schedule (runtime/scheduling.py)
asks the Kernel for each kernel role's backends (runtime/dispatch.py) and the tuner for
the backend and tile sizes that run it (runtime/tuning.py), forward and backward.
"""
from __future__ import annotations

import dataclasses
import warnings
import weakref

import torch

from .. import backends, ir
from ..backends.base import FUSED
from ..backends.tile_config import EXAMPLE
from ..codegen.generated import Generated
from ..errors import CallError, did_you_mean
from ..frontend.load import load
from ..semantics.evaluate import check_index_list
from . import configs, dispatch, ops, precompile, tuning
from ..arguments import (_shape, as_bhsd, axis_extent, bind, check_return_lse, check_seed,
                         refuse_positional, refuse_seed_without_dropout)
from .cache import load_generated
from .call_options import NO_TABLES, CallOptions
from .settings import (MAX_HEAD_DIM, MAX_HEAD_DIM_V, MIN_HEAD_DIM, SUPPORTED_DTYPES,
                       check_interpretable_dtype, check_kernel_device, check_settings,
                       interpreting)


class Kernel:
    """A compiled variant: `kernel(q, k, v, **inputs)` like scaled_dot_product_attention."""

    def __init__(self, variant: ir.Variant, config: dict | None = None, backend: str = "auto",
                 *, load: bool = True):
        check_settings()  # a bad ATTNCC_* value, seen at import, refused before any kernel
        self.variant = variant
        self.key = variant.key()  # hashed once: the tuner looks configs up on every call
        if load and not interpreting() and torch.cuda.is_available():
            precompile.warm_triton_in_background()  # while the modules below load
        portable = backends.portable().name
        self.requested_backend = dispatch.check_backend(backend)
        # A TileConfig; config= pins the portable kernels unless another backend is named.
        pins_portable = self.requested_backend in (dispatch.AUTO, portable)
        self.pinned_config = (configs.pin(config, variant, "config", portable=pins_portable)
                              if config else None)
        # The backends that may run this variant here, in order of preference; the first
        # is kernel.backend (runtime/dispatch.py).
        self.backends, self.backend_reason = dispatch.kernel_backends(
            variant, self.requested_backend,
            lambda: bool(self.pinned_config or configs.env_config()))
        self.backend = self.backends[0].name
        self._modules = {}  # backend name -> (Generated, module), each imported on first use
        if load:
            for name in dict.fromkeys((portable, self.backend)):
                self._modules[name] = load_generated(variant, name)
        self._last_backend = None  # (backend, reason) of the latest forward call
        self._last_backward = {}  # and of the latest backward's "dq" and "dkdv" kernels
        self._index_lists = ir.index_lists(variant.layout)  # {input: "qb" | "kb"}
        self._checked_lists: dict = {}  # index-list state -> weakref to the tensor checked
        self._tables_owner = self  # whose tile_tables(...) this kernel's calls accept
        self._shape_densities: dict = {}  # for the shipped winners' class (tuning_inputs)
        self.input_names = [d.name for d in variant.inputs]  # the operator's input order
        self._ops = ops.operators(self)  # torch.ops.attncc.<name>_<key>_<revision>[_bwd]
        self._op_id = ops.register_kernel(self)  # how the operator finds this kernel
        # kernel.decode's operator, defined now: torch.compile cannot trace its definition.
        self._decode_op = ops.decode_operator(self)  # torch.ops.attncc.<name>_<key>_<revision>_decode
        self._decode_plans: dict = {}  # plan key -> DecodePlan (runtime/decoding.py)
        self._call_plans: dict = {}  # plan key -> a call's Plan (runtime/call_plans.py)
        self._checked_calls: dict = {}  # call signature -> its Problem (_check_call_once)
        # The same variant without dropout, for training=False: its module is generated on
        # first use, but the Kernel exists now, so that torch.compile can trace a call of
        # it (a kernel made at trace time would be file reads and writes, untraceable).
        self._without_dropout = None
        if variant.dropout:
            self._without_dropout = Kernel(dataclasses.replace(variant, dropout=None),
                                           config, backend, load=False)
            self._without_dropout._tables_owner = self

    @property
    def generated(self) -> Generated:
        return self._load(backends.portable().name)[0]

    @property
    def module(self):
        """The generated portable module (imported on first use for an evaluation kernel):
        every backend's kernels take their tile tables and argument values from it."""
        return self._load(backends.portable().name)[1]

    def module_of(self, backend: str):
        """The generated module of the backend named `backend` (imported on first use)."""
        return self._load(backend)[1]

    def _load(self, backend: str) -> tuple:
        if backend not in self._modules:
            self._modules[backend] = load_generated(self.variant, backend)
        return self._modules[backend]

    @property
    def last_backend(self):
        """(backend, reason) of the latest forward call, or None before the first."""
        return self._last_backend

    @property
    def last_backward(self) -> dict:
        """{"dq": (backend, reason), "dkdv": (backend, reason)} of the latest backward
        ({} before the first; {"bwd": ...} where dQ and dK/dV run in one launch;
        {"fused": ...} where deterministic=False ran the fused backward)."""
        return dict(self._last_backward)

    # ------------------------------------------------ kernel roles: backends and configs
    def forward_role(self, q, k, v, values: dict, common: dict) -> dispatch.Role:
        """This call's forward and how each backend that may run it launches it, with the
        keyword arguments `common` (offsets, seed, tables). Decided on the real tensors
        (strides, alignment), so that a traced call decides on every run as an eager one
        does. The single-device op and each context-parallel piece come here."""
        return dispatch.make_role(self, "fwd", q, k, v, lambda backend: self.forward_run(
            backend, q, k, v, values, common))

    def forward_run(self, backend, q, k, v, values: dict, common: dict):
        """run(config): this call's forward on `backend` (a backend object)."""
        return tuning.launcher(self._entry(backend, "fwd"), q, k, v, values, **common)

    def backward_role(self, kind, q, k, v, lse, delta, dout, values: dict, common: dict,
                      out=None, dlse=None) -> dispatch.Role:
        """This call's dQ (kind "dq"; `out`, the forward's output: the kernel computes delta
        from it, minus `dlse`, the returned LSE's gradient, where given) or dK/dV (kind
        "dkdv"), as forward_role decides the forward."""
        return dispatch.make_role(self, kind, q, k, v, lambda backend: self.backward_run(
            backend, kind, q, k, v, lse, delta, dout, values, common, out=out, dlse=dlse))

    def backward_run(self, backend, kind, q, k, v, lse, delta, dout, values: dict, common: dict,
                     out=None, dlse=None):
        """run(config): this call's dQ or dK/dV (as backward_role) on `backend`."""
        extra = dict(out=out, dlse=dlse) if kind == "dq" else {}
        return tuning.launcher(self._entry(backend, kind), q, k, v, lse, delta, dout, values,
                               **extra, **common)

    def one_launch_role(self, q, k, v, lse, delta, dout, values: dict,
                        common: dict) -> dispatch.Role:
        """dK/dV and dQ of a table-driven variant in one launch: the portable module's."""
        portable = backends.portable()
        run = tuning.launcher(self._entry(portable, "bwd"), q, k, v, lse, delta, dout, values,
                              **common)
        return dispatch.Role("bwd", {portable.name: run}, dispatch.one_launch_reason())

    def split_preferred(self, q, k, v) -> bool:
        """Whether a backend other than the portable one takes both this call's dQ and its
        dK/dV (the Gluon kernels on Hopper): a table-driven variant's backward then runs
        them apart under ATTNCC_BACKWARD=auto, not in the portable one launch
        (settings.backward_directions)."""
        portable = backends.portable()
        return all(dispatch.role_backends(self, kind, q, k, v)[0][0] is not portable
                   for kind in ("dq", "dkdv"))

    def fused_backend(self, q, k, v):
        """The first of the kernel's backends whose fused backward (dK, dV and dQ in one
        pass, dQ added across key tiles in no fixed order: deterministic=False) takes this
        call, or None: the deterministic kernels run, and last_backward's "fused" entry
        says why (the backends' reasons)."""
        portable = backends.portable()
        reasons = []
        for backend in self.backends:
            if backend is portable:
                continue
            why = backend.supports_call(self.variant, q, k, v, FUSED)
            if why is None:
                return backend
            reasons.append(f"{backend.title}: {why}")
        if self.backends == (portable,):  # (the portable backend has no fused backward)
            reasons.append(self.backend_reason)
        self._last_backward[FUSED] = (None, "deterministic=False, but no fused backward takes "
                                      "this call (" + "; ".join(reasons) + "): the deterministic "
                                      "kernels ran")
        return None

    def fused_role(self, backend, q, k, v, lse, delta, dout, values: dict,
                   common: dict) -> dispatch.Role:
        """This call's fused backward on `backend` (fused_backend's)."""
        run = tuning.launcher(self._entry(backend, FUSED), q, k, v, lse, delta, dout, values,
                              **common)
        return dispatch.Role(FUSED, {backend.name: run},
                             f"deterministic=False: dK, dV and dQ in one {backend.title} pass, "
                             f"dQ added across key tiles in no fixed order ({backend.fused_add})")

    def _entry(self, backend, kind: str):
        return backend.entry(self.module_of(backend.name), kind)

    def choose(self, role: dispatch.Role, problem, dtype, tune=(None, None, None)) -> tuple:
        """(run, config) of `role` for this call: the backend and tile config the tuner
        chose (runtime/tuning.py; `tune`, tuning_inputs' hints). kernel.last_backend, or
        last_backward of the role, says which backend and why."""
        choice = tuning.choose(self, problem, dtype, role.direction, role.runs, *tune)
        why = role.reason
        if why is None:
            why = dispatch.tuner_reason(role, choice.backend, tuning.untimed_reason())
        self.record_choice(role.direction, (choice.backend, why))
        return role.runs[choice.backend], choice.config

    def record_choice(self, direction: str, ran: tuple):
        """(backend, reason) ran role `direction` of this call: last_backend or
        last_backward reports it."""
        if direction == "fwd":
            self._last_backend = ran
        else:
            self._last_backward[direction] = ran

    def begin_backward(self):
        """A backward starts: last_backward reports its kernels alone."""
        self._last_backward = {}

    @property
    def source(self) -> str:
        return self.generated.source

    @property
    def strategy(self) -> str:
        return self.generated.strategy

    def __repr__(self):
        return f"<attncc kernel '{self.variant.name}' ({self.backend} forward): {self.strategy}>"

    def check_call(self, q, k, v, inputs, q_offset, k_offset, layout=None, *,
                   index_lists: bool = True):
        """The call's Problem, or a CallError naming what is wrong. Reads shapes, dtypes
        and devices only, so that torch.compile can run it on FakeTensors at trace time,
        except for the index-list check (it reads values), which calls through the
        operator leave to the operator (`index_lists=False`)."""
        p = bind(self.variant, q, k, v, inputs, q_offset=q_offset, k_offset=k_offset,
                 layout=layout)
        check_kernel_device(q)
        if q.dtype not in SUPPORTED_DTYPES:
            raise CallError(f"q, k, v have dtype {q.dtype}; the kernels take float16, bfloat16 "
                            "or float32 (attncc.reference computes in any dtype, float64 included)")
        check_interpretable_dtype(q)
        if not (MIN_HEAD_DIM <= p.dim <= MAX_HEAD_DIM):
            raise CallError(f"head dim {p.dim} is not supported: the kernels take head dims "
                            f"{MIN_HEAD_DIM} to {MAX_HEAD_DIM} (q has shape {_shape(q)})")
        if not (MIN_HEAD_DIM <= p.dim_v <= MAX_HEAD_DIM_V):
            raise CallError(f"v's head dim {p.dim_v} is not supported: the kernels take v head "
                            f"dims {MIN_HEAD_DIM} to {MAX_HEAD_DIM_V} (v has shape {_shape(v)})")
        # Every launch is one grid axis of programs per tile and batch·head (at least
        # 16-row tiles), which CUDA caps at 2**31 - 1.
        tiles = -(-p.len_q // 16) + -(-p.len_k // 16)
        if tiles * p.batch * p.heads_q >= 2 ** 31:
            raise CallError(f"batch {p.batch} x {p.heads_q} heads x {tiles} tiles of 16 positions "
                            "is more programs than one launch can hold (2**31 - 1); split the "
                            "batch into several calls")
        if self.variant.layout is not None:
            b = self.variant.block
            if q_offset % b or k_offset % b:
                raise CallError(f"q_offset={q_offset} and k_offset={k_offset} must be multiples of "
                                f"the layout's block {b}, so that kernel tiles nest in layout blocks")
        if index_lists:
            self.check_index_lists(p, inputs)
        return p

    def _check_call_once(self, q, k, v, inputs, q_offset, k_offset, layout):
        """check_call(..., index_lists=False), remembered per call signature in eager
        mode: its checks read only what the signature holds (each tensor's type, shape,
        dtype and device, whether inputs require grad, the offsets and their types, the
        layout, grad mode, the interpreter), so a call like a checked one passes as it
        did, without the ~10-30 us of the checks. Under torch.compile they run at every
        trace, on fake tensors."""
        key = None
        if not torch.compiler.is_compiling():
            try:
                key = (_signature(q), _signature(k), _signature(v),
                       tuple([(name, _signature(t), t.requires_grad)
                              for name, t in inputs.items()]),
                       type(q_offset), q_offset, type(k_offset), k_offset, layout,
                       torch.is_grad_enabled(), interpreting())
                p = self._checked_calls.get(key)
            except TypeError:  # not a plain tensor, or an unhashable option: check it
                key, p = None, None
            if p is not None:
                return p
        p = self.check_call(q, k, v, inputs, q_offset, k_offset, layout, index_lists=False)
        if key is not None:
            if len(self._checked_calls) >= 64:
                self._checked_calls.pop(next(iter(self._checked_calls), None), None)
            self._checked_calls[key] = p
        return p

    def check_deterministic(self, p, inputs, deterministic):
        """deterministic=True, or torch.use_deterministic_algorithms(True) whatever the
        argument says (PyTorch's contract for the flag): a CallError naming the first
        learnable input that takes gradients whose backward for this call would add with
        fp32 atomics (its read has no owning program, attncc/analysis/gradient_owners.py,
        or its partials exceed the call's budget); under the flag's warn_only, a warning.
        Shapes only: torch.compile runs it at trace time."""
        globally = torch.are_deterministic_algorithms_enabled()
        if not (deterministic or globally):
            return
        if not (torch.is_grad_enabled() and self.variant.learnable_inputs):
            return
        atomic = self.module.atomic_reads(p.batch, p.heads_q, p.len_q, p.len_k, inputs)
        # Imported here: the analysis needs sympy, which a warm start never imports.
        from ..analysis import gradient_owners
        from ..backends.portable.codegen import per_pair
        # The reads as the kernels see a pair: under `normalize sum` or `none`, weight's.
        pair = per_pair(self.variant)
        for name in atomic:
            if not inputs[name].requires_grad:
                continue
            owners = [o for o in gradient_owners.gradient_owners(
                pair, gradient_owners.learnable_reads(pair)) if o.load.tensor == name]
            read = next(o for o in owners if not o.deterministic)
            text = ir.print_expr(read.load)
            if read.kind == "shared":
                why = (f"its read `{text}` is shared by several batch rows or heads, and one "
                       f"partial per (batch, head) of the (q, k) plane ({p.batch} x {p.heads_q} x "
                       f"{p.len_q} x {p.len_k} fp32) exceeds this call's memory budget")
                fix = "index it by b and h as well, or shorten the call"
            else:
                why = (f"no kernel program owns the elements of its read `{text}` (an index "
                       "that is not b, h, q, k, a constant, or one axis of at most "
                       f"{gradient_owners.MAX_TABLE_SLOTS} entries read through q and k)")
                fix = "index it plainly (as README's 'Deterministic gradients' lists)"
            if deterministic:
                raise CallError(f"deterministic=True, but the gradient of learnable input "
                                f"'{name}' would be added with fp32 atomics, which are not "
                                f"bit-reproducible: {why}; {fix}, or leave deterministic= "
                                "out (or False) to allow them")
            message = (f"torch.use_deterministic_algorithms(True) is on, but the gradient of "
                       f"learnable input '{name}' would be added with fp32 atomics, which are "
                       f"not bit-reproducible: {why}; {fix}, or turn the flag off for this call")
            if torch.is_deterministic_algorithms_warn_only_enabled():
                warnings.warn(message, UserWarning, stacklevel=3)
                return
            raise CallError(message)

    def check_index_lists(self, p, inputs):
        """Index lists must hold distinct tile indices in range. Checking reads the values
        (a host synchronisation), so each list is checked once while it is unchanged: the
        same memory, version and shape, held by the same live tensor (the base of a view).
        The address alone is not enough: a new tensor allocated where a checked one was
        freed has the same address and version 0, and would skip its check."""
        for name, tile in self._index_lists.items():
            t = inputs[name]
            n_tiles = axis_extent(tile, self.variant, p)
            if t.is_inference():  # no version counter to see a write by: checked every call
                check_index_list(name, t, n_tiles)
                continue
            owner = t if t._base is None else t._base
            key = (name, _state(t), n_tiles)
            checked = self._checked_lists.get(key)
            if checked is not None and checked() is owner:
                continue
            check_index_list(name, t, n_tiles)
            if len(self._checked_lists) >= 64:
                self._checked_lists.pop(next(iter(self._checked_lists)))
            self._checked_lists[key] = weakref.ref(owner)

    def evaluation_kernel(self) -> "Kernel":
        """This variant without its dropout (the kernel `training=False` runs): compiled,
        and tuned, on first use. Without dropout in the variant, the kernel itself."""
        return self._without_dropout if self.variant.dropout else self

    def __call__(self, q, k, v, /, *positional, return_lse: bool = False,
                 dropout_seed: int | None = None, training: bool = True, q_offset: int = 0,
                 k_offset: int = 0, tables: "TileTables | None" = None, layout: str | None = None,
                 deterministic: bool | None = None, **inputs):
        # Everything up to the operator call is what torch.compile traces (attncc/runtime/ops.py):
        # Python on shapes, dtypes and devices, no tensor data read.
        if positional:
            refuse_positional(self.variant, positional)
        if not torch.compiler.is_compiling():
            _refuse_transforms((q, k, v, *inputs.values()))
        check_return_lse(self.variant, return_lse)
        if not isinstance(training, bool):
            raise CallError(f"training must be True or False, got {training!r}")
        if deterministic is not None and not isinstance(deterministic, bool):
            raise CallError(f"deterministic must be True or False (or None, the default: "
                            f"deterministic q, k, v gradients), got {deterministic!r}")
        refuse_seed_without_dropout(self.variant, dropout_seed)
        if dropout_seed is not None:
            dropout_seed = check_seed(dropout_seed)
        if not training and self.variant.dropout:
            # Evaluation: the same attention with no dropout (as nn.Dropout in eval mode).
            return self.evaluation_kernel()(q, k, v, return_lse=return_lse, q_offset=q_offset,
                                            k_offset=k_offset, tables=tables, layout=layout,
                                            deterministic=deterministic, **inputs)
        p = self._check_call_once(q, k, v, inputs, q_offset, k_offset, layout)
        self.check_deterministic(p, inputs, deterministic)
        if tables is not None:
            if not isinstance(tables, TileTables):
                raise CallError(f"tables must come from kernel.tile_tables(...), got "
                                f"{type(tables).__name__}")
            tables.check(self._tables_owner, p)
        seed, drawn_seed = 0, None
        if self.variant.dropout:
            if dropout_seed is None:
                # A CPU tensor from torch's generator (torch.manual_seed reproduces it):
                # no device sync, and under torch.compile an op of the graph, so every run
                # draws anew (an int drawn here would be a constant of the graph).
                drawn_seed = torch.randint(0, 2 ** 31 - 1, (1,))
            else:
                seed = dropout_seed
        # Learnable inputs take gradients at their own strides: make them dense.
        values = [inputs[d.name].contiguous() if d.learnable else inputs[d.name]
                  for d in self.variant.inputs]
        options = CallOptions(q_offset=q_offset, k_offset=k_offset, seed=seed,
                              drawn_seed=drawn_seed,
                              tables=NO_TABLES if tables is None else tables._op_id,
                              deterministic=deterministic is not False)
        # (batch, seq, heads, dim) is read through transposed views: the kernels take any
        # strides, and the output (allocated like q) comes back in the caller's layout.
        # Under torch.compile, the op (a node of the graph) on views made here; in eager,
        # its autograd kernel, which makes them itself (ops.py: fewer autograd nodes).
        if torch.compiler.is_compiling():
            out, lse = self._ops.forward(self._op_id, *(as_bhsd(t, layout) for t in (q, k, v)),
                                         values, *options.op_arguments())
        else:
            out, lse = self._ops.apply(self._op_id, q, k, v, values, *options.op_arguments(),
                                       layout=layout)
        out = as_bhsd(out, layout)
        return (out, lse) if return_lse else out

    def check(self, q, k, v, /, *, dout=None, seed: int = 0, q_offset: int = 0,
              k_offset: int = 0, layout: str | None = None, **inputs):
        """This kernel against attncc.reference (float64) on your own q, k, v and inputs,
        at the offsets and in the layout a call would take them, forward and backward,
        held to `attncc check`'s rule; dO (q's shape) is drawn from `seed` unless given.
        Returns a CheckReport (.ok, .failed, .rows; print it for the table) and warns
        about params these lengths never exercise."""
        from .checking import check_tensors
        return check_tensors(self, q, k, v, inputs, dout=dout, seed=seed, q_offset=q_offset,
                             k_offset=k_offset, layout=layout)

    def tuning_inputs(self, p, inputs: dict, device, tables=None) -> tuple:
        """The tuner's (context, density, shape_density) for a call (tuning.choose).
        Kept tables know their density (one sync, once), so their calls tune per density
        bucket; without them the config is keyed by shape, chosen on the first layout.
        shape_density() is the call's tile density, for the shipped winners' class: one
        sync, once per shape (the first inputs of a shape stand for the later ones, as the
        configs chosen on them do)."""
        def shape_density():
            key = (p.batch, p.heads_q, p.len_q, p.len_k, p.q_offset, p.k_offset)
            if key not in self._shape_densities:
                if len(self._shape_densities) >= 64:
                    self._shape_densities.pop(next(iter(self._shape_densities)))
                block = self.variant.block or 64
                where = device
                if not self.module.TABLE_INPUTS and _tile_count(p, block) <= HOST_DENSITY_TILES:
                    # Nothing read from tensors, few tiles: on the host, with no device
                    # kernels to load and no sync (0.23 s of a warm start: run 100).
                    where = "cpu"
                self._shape_densities[key] = tile_density(self.module, p, inputs, where, block)
            return self._shape_densities[key]
        return (self._tuning_context(p, inputs, device, tables),
                tables.density if tables is not None else None, shape_density)
    def decode(self, q, /, k_cache, v_cache, *, cache_seqlens=None, k_new=None, v_new=None,
               block_table=None, return_lse: bool = False, num_splits: int | None = None,
               config: dict | None = None, **inputs):
        """Split-KV decoding: n_q new query tokens per batch row against a KV cache.

        q (B, Hq, n_q, D). The cache is contiguous, k_cache and v_cache (B, Hkv, capacity,
        D) (any strides: a (B, capacity, Hkv, D) cache passes as cache.transpose(1, 2)),
        or paged, (num_pages, page_size, Hkv, D) with block_table (B, max_pages) int32.
        cache_seqlens: keys cached per row, a (B,) int32 tensor or an int. k_new, v_new
        (B, Hkv, n_new, D), optional: written into the cache in place at positions
        cache_seqlens[b] + j first (the caller advances cache_seqlens afterwards).

        Row b then holds L = cache_seqlens[b] + n_new keys, and the call computes the last
        n_q rows of its self-attention over them: query token i at position L - n_q + i,
        and len_q = len_k = L in the variant (so `q >= k` is causal). Input axes on
        positions and tiles span the capacity. Returns (B, Hq, n_q, D), and with
        return_lse the natural LSE (B, Hq, n_q) in float32; a row that attends to no key
        gives 0 and LSE -inf. An int cache_seqlens outside [0, capacity - n_new] is
        refused; a tensor's lengths are clamped to [0, capacity] and block-table entries
        to [0, num_pages) (not read on the host), as decode_reference reads them. An
        operator of its own (torch.compile traces it whole). Inference only: no autograd
        graph (a backward reaching the output raises where a tensor asks for gradients),
        no dropout. num_splits
        or config={"BLOCK_N", "num_warps", "num_stages", "num_splits"} pin what is
        otherwise tuned (attncc/runtime/decoding.py)."""
        from .decoding import decode
        return decode(self, q, k_cache, v_cache, cache_seqlens=cache_seqlens, k_new=k_new,
                      v_new=v_new, block_table=block_table, return_lse=return_lse,
                      num_splits=num_splits, config=config, **inputs)

    def _tuning_context(self, p, inputs: dict, device, tables=None):
        """For the tuner's progress lines: the density of the layout a layout variant is
        tuned on, since its config then serves other layouts of the same shape (kept
        tables: other layouts of the same density bucket; they know their density)."""
        if tables is not None:
            return lambda: f"on kept tables of tile density {tables.density:.3f}"
        if self.variant.block is None or not self.module.USES_TABLES:
            return None
        return lambda: (f"on a layout of tile density "
                        f"{tile_density(self.module, p, inputs, device, self.variant.block):.3f}")

    def tile_tables(self, q, k, v, /, *, q_offset: int = 0, k_offset: int = 0,
                    layout: str | None = None, **inputs) -> "TileTables":
        """Tile tables for calls shaped like this one, to keep and pass as `tables=`.

        Without them the kernel keeps the tables of its 32 latest calls, keyed by the
        tensors they read and their version counters (ATTNCC_TABLE_CACHE=0 builds them on
        every call instead). Keep them yourself to hold more (many layers with layouts of
        their own) or to build them once, outside a training step. They are your promise
        that the tensors they read keep their contents. Building them reads their
        density (one sync);
        calls given them are tuned per density bucket and make no host synchronisation
        and no table work (CUDA graphs can capture them)."""
        p = self.check_call(q, k, v, inputs, q_offset, k_offset, layout)
        if not self.module.USES_TABLES:
            raise CallError(f"variant '{self.variant.name}' has no tile tables to keep: its "
                            f"kernels skip tiles by analytic bounds ({self.strategy}); call "
                            "the kernel without tables=")
        # Owned by the kernel whose calls take them: an evaluation kernel's tables are its
        # training kernel's (training=False calls pass them on), and were refused by both.
        return TileTables(self._tables_owner, p, inputs, q.device)

    def density(self, q, k, v, /, *, block: int | None = None, q_offset: int = 0,
                k_offset: int = 0, layout: str | None = None, **inputs) -> float:
        """The fraction of block x block tiles (default: the layout's block, else 64) that
        the kernels visit for calls shaped like this one, averaged over batch and heads.
        Tiles are classified as the tables do, so this may count a tile the kernels'
        analytic bounds would skip, never the reverse. Reads the result: one sync."""
        if block is not None and (isinstance(block, bool) or not isinstance(block, int)
                                  or block < 1):
            raise CallError(f"block must be a positive int (a tile side in positions), got "
                            f"{block!r}; leave it out for the layout's block, else 64")
        p = self.check_call(q, k, v, inputs, q_offset, k_offset, layout)
        return tile_density(self.module, p, inputs, q.device, block or self.variant.block or 64)


HOST_DENSITY_TILES = 1 << 18  # query tiles x key tiles: 512 x 512, 64-blocks at 32K


def _tile_count(p, block: int) -> int:
    return -(-p.len_q // block) * -(-p.len_k // block)


def tile_density(module, p, inputs: dict, device, block: int) -> float:
    if block < 1:
        raise CallError(f"block must be a positive number of positions, got {block}")
    if ops.empty_problem(p):
        return 0.0  # no tile at all, so none visited (and calls with it compute nothing)
    t = module.tile_tables(p.batch, p.heads_q, p.len_q, p.len_k, p.q_offset, p.k_offset, p.dim,
                           inputs, block, block, device)
    visited = (t["row_full_count"] + t["row_part_count"]).float().mean()
    return visited.item() / -(-p.len_k // block)


class TileTables:
    """A kernel's tile tables for one problem shape and one state of the tensors the mask
    and layout read, built by `kernel.tile_tables(...)` and passed as `kernel(...,
    tables=t)`. Tables for each tile size the kernels use are built on first use and
    kept here. A call whose shapes differ, or whose mask or layout tensors are other
    tensors or were written in place since (their version counter moved), is refused:
    such tables would skip the wrong tiles. A write that bypasses the version counter
    (or to an inference tensor, which has none) is not seen: keeping the tables is the
    caller's promise that there is none."""

    def __init__(self, kernel: Kernel, problem, inputs: dict, device):
        self.kernel, self.problem, self.device = kernel, problem, device
        self._op_id = ops.register_tables(self)  # how the operator finds them (attncc/runtime/ops.py)
        self._reads = {name: _state(inputs[name]) for name in kernel.module.TABLE_INPUTS}
        self._inputs = {name: inputs[name] for name in kernel.module.TABLE_INPUTS}
        self.store: dict = {}  # (BLOCK_M, BLOCK_N) -> tables; filled by the generated module
        # The fraction of tiles visited (see Kernel.density), at the layout's block: read
        # here, outside the calls (one sync), since calls with these tables tune per
        # density bucket.
        self.density = tile_density(kernel.module, problem, self._inputs, device,
                                    kernel.variant.block or 64)

    def check(self, kernel: Kernel, problem):
        """Whether a call of `kernel` shaped as `problem` may use these tables. Shapes only:
        at trace time under torch.compile (where it fixes the shapes, as tables do)."""
        if kernel.module is not self.kernel.module:
            # Another compile of the same variant shares its module, and so its tables.
            raise CallError(f"these tables belong to a kernel of variant "
                            f"'{self.kernel.variant.name}', whose tiles differ from this "
                            f"kernel's ('{kernel.variant.name}'); build them with this "
                            "kernel's tile_tables(...)")
        if _sizes(problem) != _sizes(self.problem):  # field by field: Dynamo compares ints
            raise CallError(f"these tables were built for {_shape_text(self.problem)}, but this "
                            f"call is {_shape_text(problem)}; build tables for it with "
                            "kernel.tile_tables(...)")

    def check_reads(self, inputs: dict):
        """Whether the tensors the tables were built from are the call's, unchanged. Reads
        data pointers and version counters: in the operator, where tensors are real."""
        for name, state in self._reads.items():
            t = inputs[name]
            if _state(t) != state:
                hint = ""
                if t.is_cuda and torch.cuda.is_current_stream_capturing():
                    hint = (f"; if torch.compile(mode=\"reduce-overhead\") is capturing this call, "
                            f"it copied '{name}' into a buffer of its own: mark it with "
                            f"torch._dynamo.mark_static_address({name}) so it keeps its address")
                raise CallError(f"these tables were built from another '{name}' (or it was "
                                "written in place since); rebuild them with "
                                f"kernel.tile_tables(...) when it changes{hint}")

    def __repr__(self):
        sizes = ", ".join(f"{m}x{n}" for m, n in self.store) or "none yet"
        return (f"<attncc tile tables for '{self.kernel.variant.name}', "
                f"{_shape_text(self.problem)}; tile sizes built: {sizes}>")


def _signature(t) -> tuple:
    """What the call checks read of a tensor; TypeError for anything but a plain tensor or
    a Parameter (a subclass may answer them otherwise)."""
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        raise TypeError
    return type(t), t.shape, t.dtype, t.device


def _refuse_transforms(tensors):
    """A CallError for what the kernels have no rule for: torch.func's transforms (vmap,
    grad, jvp wrap the tensors; PyTorch failed inside with "Cannot access data pointer")
    and forward-mode AD's dual tensors (whose tangent the output silently lost)."""
    from torch.autograd import forward_ad
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        if torch._C._functorch.is_functorch_wrapped_tensor(t):
            raise CallError("torch.func transforms (vmap, grad, jacrev, jvp) cannot run attncc "
                            "kernels: call them outside the transform (a batch dimension is "
                            "the kernels' own: stack it into batch or heads), and take "
                            "gradients with torch.autograd")
        if forward_ad._current_level >= 0 and forward_ad.unpack_dual(t).tangent is not None:
            raise CallError("forward-mode AD (a dual tensor from torch.autograd.forward_ad) "
                            "is not supported by attncc kernels: their output would carry "
                            "no tangent; use reverse mode (backward, torch.autograd.grad), "
                            "or attncc.reference for a directional derivative")


def _state(t: torch.Tensor) -> tuple:
    # An inference tensor has no version counter: kept tables built from one stand on its
    # address, shape and strides, and on the caller's promise not to write it.
    version = None if t.is_inference() else t._version
    return (t.data_ptr(), version, tuple(t.shape), t.stride(), t.dtype, str(t.device))


def _sizes(p) -> tuple:
    return (p.batch, p.heads_q, p.heads_kv, p.len_q, p.len_k, p.dim, p.dim_v, p.q_offset,
            p.k_offset)


def _shape_text(p) -> str:
    b, hq, hk, lq, lk, d, _, qo, ko = _sizes(p)
    text = f"batch {b}, heads {hq}/{hk}, len_q {lq}, len_k {lk}, dim {d}"
    if qo or ko:
        text += f", offsets {qo}/{ko}"
    return text


def compile_variant(variant: ir.Variant, *, config: dict | None = None,
                    backend: str = "auto") -> Kernel:
    return Kernel(variant, config, backend)


# ------------------------------------------------------------ attncc.compile
def compile(spec, *, backend: str = "auto", config: dict | None = None, **unknown):
    """Compile a variant into a differentiable kernel: kernel(q, k, v, **inputs).

    backend="auto" (default), "triton" (the portable kernels, everywhere) or another
    registered backend's name (attncc/backends/__init__.py): which kernels may run; see
    kernel.backend and kernel.backend_reason. `config` pins the kernels' tiles:
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}. Everything else
    about the attention is part of the variant."""
    if unknown:
        raise TypeError(_compile_option_hint(*next(iter(unknown.items()))))
    return compile_variant(load(spec), backend=backend, config=config)


def _compile_option_hint(name: str, value) -> str:
    """Why attncc.compile() takes no `name=`, and what to write instead."""
    if name == "block":
        block = value if isinstance(value, int) and not isinstance(value, bool) else 64
        return (f"attncc.compile() takes no block=: a layout's block is part of the variant; "
                f"declare `block {block}` in the spec (block= in @attncc.variant). Kernel "
                f"tile sizes are pinned with config={EXAMPLE}")
    if name in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"):
        return (f"attncc.compile() takes no {name}=: pin the tiles together, as "
                f"config={EXAMPLE}")
    if name in ("heads", "scale", "dropout", "mask", "score", "layout", "params", "inputs", "sink"):
        return (f"attncc.compile() takes no {name}=: it is part of the variant; declare it in "
                f"the spec (or in @attncc.variant)")
    return (f"attncc.compile() got an unexpected keyword argument '{name}'; it takes a spec "
            f"(a path, spec text or Variant), backend= and config={EXAMPLE} to pin tiles"
            f"{did_you_mean(name, ('backend', 'config'))}")
