"""Launching a Triton kernel again without the JIT's per-call work: `Launch`.

`kernel[grid](*args, **options)` binds every argument, computes each one's
specialization (dtype, 16-byte alignment, ints equal to 1 or divisible by 16), hashes
them into a cache key, looks the compiled kernel up and builds its launch metadata: tens
of microseconds for a kernel of ~45 arguments, paid on every call. A caller that already
knows the next call specializes as the last one did (kernel.decode's launch plans,
keyed on every shape, stride, dtype, alignment and option: attncc/runtime/decoding.py)
can hand the arguments straight to the `CompiledKernel` the JIT returned. Its
`run(grid_x, grid_y, grid_z, stream, function, packed_metadata, launch_metadata,
enter_hook, exit_hook, *arguments)` is what the JIT itself calls, with the same
arguments, on Triton 3.6 and 3.9 alike (Triton's JITFunction.run, in its runtime/jit
module).

The JIT path is kept where the shortcut would not be the same launch: under the
interpreter (nothing is compiled), when a launch hook is installed (a profiler such as
proton reads the launch metadata the shortcut does not build), and when the kernel
takes an argument not passed here (a default), whose value the shortcut would not know.
"""
from __future__ import annotations

import triton


def current_device() -> int:
    """The CUDA device Triton's JIT compiles and launches for: PyTorch's current one."""
    return triton.runtime.driver.active.get_current_device()


def current_stream(device: int) -> int:
    """The raw CUDA stream kernels launch on: PyTorch's current stream of `device`, as
    Triton's JIT launches on it."""
    return triton.runtime.driver.active.get_current_stream(device)


def _hooks_installed() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        return True  # a Triton without knobs: leave every launch to its JIT
    runtime = knobs.runtime
    # Triton 3.6 and 3.9 hold the hooks in a HookChain (empty: `calls == []`); older
    # versions in a plain attribute (None: no hook).
    return any(getattr(hook, "calls", hook) for hook in (runtime.launch_enter_hook,
                                                         runtime.launch_exit_hook))


class Launch:
    """One kernel launched on one grid with fixed options (constexprs and num_warps,
    num_stages), called with its positional arguments, as `kernel[grid](*args,
    **options)`. The first call goes through the JIT and keeps the compiled kernel it
    returns; later calls hand their arguments to that kernel directly. The caller
    promises that every call specializes as the first did: the same dtypes, the same
    pointer alignment, the same integer arguments wherever the JIT specializes them."""

    __slots__ = ("kernel", "grid", "options", "compiled", "tail", "device")

    def __init__(self, kernel, grid: tuple, options: dict):
        self.kernel = kernel
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.options = options
        self.compiled = None  # the CompiledKernel, once the JIT has returned one
        self.tail = ()  # the constexpr arguments, in the kernel's parameter order
        self.device = None

    def __call__(self, *args) -> None:
        compiled = self.compiled
        if compiled is not None and not _hooks_installed():
            x, y, z = self.grid
            compiled.run(x, y, z, current_stream(self.device), compiled.function,
                         compiled.packed_metadata, None, None, None, *args, *self.tail)
            return
        result = self.kernel[self.grid](*args, **self.options)
        if compiled is None:
            self._keep(result, len(args))

    def _keep(self, result, n_args: int) -> None:
        """Keep the JIT's compiled kernel when the direct launch can pass what it passed."""
        if hasattr(result, "result"):  # Triton 3.6's asynchronous compile: a future
            result = result.result()
        if not all(hasattr(result, a) for a in ("run", "function", "packed_metadata")):
            return  # the interpreter returns nothing to relaunch
        rest = self.kernel.arg_names[n_args:]
        if any(name not in self.options for name in rest):
            return
        self.tail = tuple(self.options[name] for name in rest)
        self.device = current_device()
        self.compiled = result
