"""Compiled kernels at run time: the module cache, call checks, and the autograd.Function.

`compile_variant` renders the variant's Triton module (attncc/codegen.py), writes it to
the on-disk cache under its content key and imports it. The returned `Kernel` checks
each call (naming the argument, what was given and what is expected), picks tile
sizes (attncc/tuning.py), and runs the forward and backward through autograd.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import torch

from . import ir, tuning
from .arguments import axis_extent, bind
from .codegen import generate
from .errors import CallError
from .evaluate import check_index_list

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256


def cache_dir() -> Path:
    root = os.environ.get("ATTNCC_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "attncc")
    return Path(root)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def write_if_changed(path: Path, text: str) -> bool:
    """Write atomically, and only when the content differs; True when (re)written.

    Concurrent compiles of the same variant race harmlessly, a reader never sees a
    half-written file, and a damaged file (even one that is not UTF-8) is rewritten."""
    try:
        if path.read_bytes() == text.encode():
            return False
    except OSError:
        pass  # missing or unreadable: write it
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return True


def _import_module(name: str, path: Path):
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) == str(path):
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # triton.jit reads the source through the module
    spec.loader.exec_module(module)
    return module


def load_generated(variant: ir.Variant):
    """(generated, module): render the variant and import it from the cache."""
    gen = generate(variant)
    digest = hashlib.sha256(gen.source.encode()).hexdigest()[:12]
    name = f"{gen.module_name}_{digest}"
    path = cache_dir() / "modules" / f"{name}.py"
    write_if_changed(path, gen.source)
    return gen, _import_module(name, path)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kernel, q, k, v, call, *input_values):
        inputs = dict(zip(call["input_names"], input_values))
        run = lambda config: kernel.module.forward(
            q, k, v, inputs, q_offset=call["q_offset"], k_offset=call["k_offset"],
            seed=call["seed"], config=config)
        config = tuning.config_for(kernel, call["problem"], q.dtype, "fwd", run)
        out, lse = run(config)
        ctx.save_for_backward(q, k, v, out, lse, *input_values)
        ctx.kernel, ctx.call = kernel, call
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, *input_values = ctx.saved_tensors
        call = ctx.call
        inputs = dict(zip(call["input_names"], input_values))
        module, problem = ctx.kernel.module, call["problem"]
        common = dict(q_offset=call["q_offset"], k_offset=call["k_offset"], seed=call["seed"])
        delta = module.backward_delta(out, dout)
        # dK/dV and dQ are tuned apart: they want different tile shapes.
        run_dkdv = lambda config: module.backward_dkdv(q, k, v, lse, delta, dout, inputs,
                                                       config=config, **common)
        run_dq = lambda config: module.backward_dq(q, k, v, lse, delta, dout, inputs,
                                                   config=config, **common)
        dk, dv = run_dkdv(tuning.config_for(ctx.kernel, problem, q.dtype, "dkdv", run_dkdv))
        dq, dinputs = run_dq(tuning.config_for(ctx.kernel, problem, q.dtype, "dq", run_dq))
        grads = [dinputs.get(name) for name in call["input_names"]]
        return (None, dq, dk, dv, None, *grads)


class Kernel:
    """A compiled variant: `kernel(q, k, v, **inputs)` like scaled_dot_product_attention."""

    def __init__(self, variant: ir.Variant, config: dict | None = None):
        self.variant = variant
        self.key = variant.key()  # hashed once: the tuner looks configs up on every call
        self.generated, self.module = load_generated(variant)
        self.pinned_config = tuning.check_config(config, "config") if config else None
        self._index_lists = ir.index_lists(variant.layout)  # {input: "qb" | "kb"}
        self._checked_lists: dict = {}  # index-list states already validated

    @property
    def source(self) -> str:
        return self.generated.source

    @property
    def strategy(self) -> str:
        return self.generated.strategy

    def __repr__(self):
        return f"<attncc kernel '{self.variant.name}': {self.strategy}>"

    def check_call(self, q, k, v, inputs, q_offset, k_offset):
        p = bind(self.variant, q, k, v, inputs, q_offset=q_offset, k_offset=k_offset)
        if q.device.type != "cuda" and not interpreting():
            raise CallError(f"q is on {q.device}, but attncc kernels run on CUDA GPUs; move the "
                            "tensors with .cuda(), or set TRITON_INTERPRET=1 to run the kernels "
                            "(slowly) under the Triton interpreter on the CPU")
        if q.dtype not in SUPPORTED_DTYPES:
            raise CallError(f"q, k, v have dtype {q.dtype}; the kernels take float16, bfloat16 "
                            "or float32 (attncc.reference computes in any dtype, float64 included)")
        if not (MIN_HEAD_DIM <= p.dim <= MAX_HEAD_DIM):
            raise CallError(f"head dim {p.dim} is not supported: the kernels take head dims "
                            f"{MIN_HEAD_DIM} to {MAX_HEAD_DIM} (q has shape {tuple(q.shape)})")
        if p.dim_v != p.dim:
            raise CallError(f"v has head dim {p.dim_v} but q and k have {p.dim}; the kernels need "
                            "them equal")
        if p.batch == 0 or p.heads_q == 0:
            raise CallError(f"q has shape {tuple(q.shape)}: batch and heads must be at least 1")
        if self.variant.layout is not None:
            b = self.variant.block
            if q_offset % b or k_offset % b:
                raise CallError(f"q_offset={q_offset} and k_offset={k_offset} must be multiples of "
                                f"the layout's block {b}, so that kernel tiles nest in layout blocks")
        self._check_index_lists(p, inputs)
        return p

    def _check_index_lists(self, p, inputs):
        """Index lists must hold distinct tile indices in range. Checking reads the values
        (a host synchronisation), so each list is checked once while it is unchanged."""
        for name, tile in self._index_lists.items():
            t = inputs[name]
            n_tiles = axis_extent(tile, self.variant, p)
            key = (name, t.data_ptr(), t._version, tuple(t.shape), t.stride(), n_tiles)
            if key in self._checked_lists:
                continue
            check_index_list(name, t, n_tiles)
            if len(self._checked_lists) >= 64:
                self._checked_lists.pop(next(iter(self._checked_lists)))
            self._checked_lists[key] = True

    def __call__(self, q, k, v, *, return_lse: bool = False, dropout_seed: int | None = None,
                 q_offset: int = 0, k_offset: int = 0, **inputs):
        p = self.check_call(q, k, v, inputs, q_offset, k_offset)
        if p.len_q == 0 or p.len_k == 0:
            out = q.new_zeros(q.shape[:3] + (v.shape[-1],))
            lse = torch.full(q.shape[:3], float("-inf"), device=q.device, dtype=torch.float32)
            return (out, lse) if return_lse else out
        if self.variant.dropout:
            if dropout_seed is None:
                # Drawn on the CPU generator: no device synchronisation.
                dropout_seed = int(torch.randint(0, 2 ** 31 - 1, (1,)).item())
        names = [d.name for d in self.variant.inputs]
        values = []
        for name in names:
            t = inputs[name]
            # Learnable inputs take gradients at their own strides: make them dense.
            values.append(t.contiguous() if self.variant.input(name).learnable else t)
        call = {
            "input_names": names, "q_offset": q_offset, "k_offset": k_offset,
            "seed": int(dropout_seed or 0), "problem": p,
        }
        out, lse = _Attention.apply(self, q, k, v, call, *values)
        return (out, lse) if return_lse else out


def compile_variant(variant: ir.Variant, *, config: dict | None = None) -> Kernel:
    return Kernel(variant, config)
