"""Autotuning and its on-disk cache: which tile config (runtime/configs.py) a call runs.

On a GPU the first call of a variant for a (head dim, dtype, length bucket, direction)
times the first kept candidates on the real inputs, keeps the fastest, and writes it to
disk keyed by the variant, GPU, Triton and attncc versions, so a second process does no
tuning. Configs that fail to compile or launch are skipped, never silently used.
On a GPU attncc ships measured winners for (runtime/known_winners.py), the first call
runs the winner for the variant's class instead of tuning (`ATTNCC_TUNE=full` tunes).
`ATTNCC_CONFIG` (JSON) or `attncc.compile(..., config=...)` pins one; `ATTNCC_TUNE=0`
takes the first kept candidate without timing.
"""
from __future__ import annotations

import json
import logging
import math
import os
import threading
import time

from .. import ir
from . import configs, known_winners, precompile
from .configs import density_bucket, length_bucket  # noqa: F401 - tuning keys use them

# Candidates timed per key: compiles dominate cold-start time. ATTNCC_TUNE_CANDIDATES
# raises it (to search more widely once; the winner is cached either way).
TUNE_AT_MOST = int(os.environ.get("ATTNCC_TUNE_CANDIDATES", "4"))
TUNE_WARMUP_MS, TUNE_REP_MS = 25, 100  # per candidate; do_bench's own defaults
_MEMORY: dict = {}  # tuning key -> config, for this process
_LOCK = threading.Lock()
# Progress and skipped candidates, at INFO: quiet unless the program shows attncc's logs
# (logging.basicConfig(level=logging.INFO)); the attncc command shows them on stderr.
log = logging.getLogger("attncc.tuning")  # a public name: the README tells users to filter it


TUNE_MODES = {"0": "no timing: the first candidate that compiles",
              "1": "the default: a shipped winner where one fits, else tune and cache",
              "full": "tune and cache, even where a shipped winner fits"}


def tune_mode() -> str:
    """ATTNCC_TUNE, read at each call (tests and benchmarks change it in-process)."""
    mode = os.environ.get("ATTNCC_TUNE", "1").strip() or "1"
    if mode not in TUNE_MODES:
        raise ValueError(f"ATTNCC_TUNE={mode!r} is not a tuning mode; use "
                         + "; ".join(f"{m} ({what})" for m, what in TUNE_MODES.items()))
    return mode


def _versions() -> str:
    import torch
    import triton
    from ..version import __version__
    gpu = torch.cuda.get_device_name().replace(" ", "_") if torch.cuda.is_available() else "cpu"
    return f"{gpu}-triton{triton.__version__}-torch{torch.__version__.split('+')[0]}-attncc{__version__}"


def _cache_file(variant: ir.Variant, suffix: str = ""):
    """The variant's tuning file; decoding keeps its configs (other keys) in a file of its
    own, suffix "-decode" (attncc/runtime/decoding.py)."""
    from .cache import cache_dir
    return (cache_dir() / "tuning" / _versions()
            / f"{variant.short_name}-{variant.key()}{suffix}.json")


def _load(path, check=configs.check_config) -> dict:
    """The cached winners that `check(config, where)` accepts (it raises ValueError on a
    bad one): {} when the file is missing or damaged; a damaged entry is skipped, and
    dropped by the next store, but the others are kept. Whether a config suits its
    variant is checked where it is used (usable)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    kept = {}
    for key, config in data.items():
        try:
            kept[key] = check(config, str(path))
        except (ValueError, TypeError, KeyError):
            continue
    return kept


def _store(path, key: str, config: dict, check=configs.check_config):
    """Add one winner. The read-modify-write holds an exclusive lock on a file beside the
    cache file (filelock: fcntl on POSIX, msvcrt on Windows), so processes tuning at once
    keep each other's entries (readers need no lock: every write is an atomic replace)."""
    from filelock import FileLock
    from .cache import write_if_changed
    path.parent.mkdir(parents=True, exist_ok=True)
    with _LOCK, FileLock(path.with_name(path.name + ".lock")):
        data = _load(path, check)
        data[key] = config
        write_if_changed(path, json.dumps(data, indent=1, sort_keys=True) + "\n")


def config_for(kernel, problem, dtype, direction: str, run=None, context=None,
               density=None, shape_density=None) -> dict:
    """The config for this call; `run(config)` launches the direction once (for tuning).
    Every call of a kernel comes here (three times per forward + backward), so a config
    already chosen in this process is found before any candidate is filtered.
    `context()`, called only when tuning, says what the tuning ran on beyond the key
    (a runtime layout's density), for the progress lines. `density`: the tile density
    of kept tables (known without a sync in the call); configs are then tuned per
    density bucket, since few tiles per row want shorter pipelines (RESULTS.md run 38).
    `shape_density()`: this call's tile density, for the shipped winners' class (computed
    only when this GPU has shipped winners)."""
    pinned = _pinned(kernel, direction)
    if pinned:
        return pinned
    from .settings import interpreting
    if interpreting():
        return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)
    kept = lambda: configs.kept_candidates(kernel.variant, problem.dim, direction)
    if run is None:
        return kept()[0]
    if tune_mode() == "0":
        return first_that_runs(kernel, problem, dtype, direction, kept, run)
    config, _ = untimed_config(kernel, problem, dtype, direction, density, shape_density)
    if config is not None:
        return config
    key = tuning_key(direction, problem, dtype, density)
    path = _cache_file(kernel.variant)
    best = tune(kernel.variant.name, key, kept()[:TUNE_AT_MOST], run,
                context=context() if context else "")
    _MEMORY[(kernel.key, key)] = best
    try:
        _store(path, key, best)
    except OSError as e:
        from ..errors import CacheError
        from .cache import cache_unwritable
        raise CacheError(cache_unwritable(path, e)) from None
    return best


def _pinned(kernel, direction: str):
    """The config pinned for this direction, if any. With backend="gluon", config= pins
    the Gluon forward and the (portable) backward is tuned; otherwise config= and
    ATTNCC_CONFIG pin the portable kernels."""
    gluon_pin = getattr(kernel, "requested_backend", None) == "gluon"
    if kernel.pinned_config and gluon_pin == (direction == "gluon-fwd"):
        return kernel.pinned_config  # checked when the kernel was compiled
    # ATTNCC_CONFIG pins the portable kernels; the Gluon kernels' configs have other limits.
    pinned = configs.env_config() if not direction.startswith("gluon-") else None
    return configs.check_pinned(pinned, kernel.variant, "ATTNCC_CONFIG") if pinned else None


def untimed_config(kernel, problem, dtype, direction: str, density=None, shape_density=None):
    """(config, new) where choosing this call's config needs no timing: chosen earlier in
    this process (new False), or read from the tuning cache or the shipped winners (new
    True: this process has not launched it yet, so its first launch compiles). (None,
    False) where it must be tuned, and for pinned or untuned configs (config_for's)."""
    from .settings import interpreting
    if _pinned(kernel, direction) or interpreting() or tune_mode() == "0":
        return None, False
    key = tuning_key(direction, problem, dtype, density)
    mem_key = (kernel.key, key)
    if mem_key in _MEMORY:
        return _MEMORY[mem_key], False
    cached = _load(_cache_file(kernel.variant)).get(key)
    if cached and configs.usable(cached, kernel.variant, problem.dim, direction):
        _MEMORY[mem_key] = cached
        return cached, True
    shipped = None if tune_mode() == "full" else known_winners.shipped_winner(
        kernel, problem, dtype, direction, _call_density(density, shape_density))
    if shipped is not None:  # no candidate compiled or timed: cold start is one compile
        log.info("%s %s: %s, the shipped winner for its class (ATTNCC_TUNE=full tunes "
                 "instead)", kernel.variant.name, key, configs.label(shipped))
        _MEMORY[mem_key] = shipped
        return shipped, True
    return None, False


def tuning_key(direction: str, problem, dtype, density=None) -> str:
    key = (f"{direction}-d{problem.dim}-{str(dtype).replace('torch.', '')}-g{problem.group}"
           f"-q{length_bucket(problem.len_q)}-k{length_bucket(problem.len_k)}")
    if density is not None:
        key += f"-density{density_bucket(density)}"
    return key


def _call_density(density, shape_density):
    """The tile density the shipped winners' class is read at: kept tables' own, else the
    call's (None, so no shipped winner, where the caller cannot compute it)."""
    return (lambda: density) if density is not None else shape_density


# What faster_backend decides: the backend of the forward, dQ or dK/dV kernel. The
# names are the first word of the tuning keys (no dash: known_winners.py splits on it).
BACKEND_STAGES = {"backend": "forward", "dqbackend": "dQ", "dkdvbackend": "dK/dV"}


def faster_backend(kernel, problem, dtype, options: dict, density=None,
                   shape_density=None, stage: str = "backend", may_time: bool = True):
    """The name of the faster of `options` ({backend: (direction, run)}), each timed at
    its own tuned config on this call's inputs (median of do_bench), and remembered on
    disk beside the configs. `stage`: which kernel's backend (BACKEND_STAGES). ATTNCC_TUNE=0
    times nothing and takes the portable one. With may_time=False, None where the choice
    would need timing (a caller that cannot run the kernels yet)."""
    key = tuning_key(stage, problem, dtype, density)
    mem_key = (kernel.key, key)
    if mem_key in _MEMORY:
        return _MEMORY[mem_key]
    if tune_mode() == "0":
        return "triton"
    path = _cache_file(kernel.variant)
    path = path.with_name(path.stem + "-backends.json")
    try:
        cached = json.loads(path.read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        cached = None
    if cached in options:
        _MEMORY[mem_key] = cached
        return cached
    shipped = None if tune_mode() == "full" else known_winners.shipped_winner(
        kernel, problem, dtype, stage, _call_density(density, shape_density))
    if shipped in options:  # the other backend is never compiled
        log.info("%s %s: the %s %s, the shipped winner for its class (ATTNCC_TUNE=full "
                 "times both instead)", kernel.variant.name, key, shipped, BACKEND_STAGES[stage])
        _MEMORY[mem_key] = shipped
        return shipped
    if not may_time:
        return None
    import triton
    timings = {}
    for name, (direction, run) in options.items():
        config = config_for(kernel, problem, dtype, direction, run, density=density,
                            shape_density=shape_density)
        timings[name] = triton.testing.do_bench(lambda: run(config), warmup=TUNE_WARMUP_MS,
                                                rep=TUNE_REP_MS, return_mode="median")
    best = min(timings, key=timings.get)
    log.info("%s %s: %s %s; runs %s", kernel.variant.name, key, BACKEND_STAGES[stage],
             ", ".join(f"{n} {ms:.3f} ms" for n, ms in timings.items()), best)
    _MEMORY[mem_key] = best
    from filelock import FileLock
    from .cache import write_if_changed
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _LOCK, FileLock(path.with_name(path.name + ".lock")):
            try:
                data = json.loads(path.read_text())
                data = data if isinstance(data, dict) else {}
            except (OSError, ValueError):
                data = {}
            data[key] = best
            write_if_changed(path, json.dumps(data, indent=1, sort_keys=True) + "\n")
    except OSError as e:
        from ..errors import CacheError
        from .cache import cache_unwritable
        raise CacheError(cache_unwritable(path, e)) from None
    return best


# What each direction's kernel is called in messages.
KERNEL_NAMES = {"fwd": "forward", "dq": "dQ", "dkdv": "dK/dV", "bwd": "backward",
                "gluon-fwd": "Gluon forward", "gluon-dq": "Gluon dQ", "gluon-dkdv": "Gluon dK/dV"}


def is_compile_failure(error: Exception) -> bool:
    """Whether Triton's compiler failed on the kernel (ptxas crashing or refusing it, or
    the front end), as opposed to a launch that does not fit or an error of the call."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import PTXASError
    return isinstance(error, (PTXASError, CompilationError))


def compile_failure_message(kernel, problem, dtype, direction: str, config: dict,
                            error: Exception) -> str:
    import triton
    cause = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return (f"Triton {triton.__version__} could not compile the {KERNEL_NAMES.get(direction, direction)} "
            f"kernel of '{kernel.variant.name}' at head dim {problem.dim} "
            f"({str(dtype).replace('torch.', '')}) with the tile config {configs.describe(config)} "
            f"({type(error).__name__}: {cause[:300]}). attncc keeps configs known to crash the "
            "compiler out of its candidates (runtime/configs.py, keep()); to run now, pin another "
            "config with ATTNCC_CONFIG='{\"BLOCK_M\": 64, \"BLOCK_N\": 64, \"num_warps\": 4, "
            "\"num_stages\": 3}' (or attncc.compile(..., config=...)), or retune with "
            "ATTNCC_TUNE=full, and please report the variant, head dim, dtype and config")


def launch(kernel, problem, dtype, direction: str, run, config: dict):
    """run(config), with a failure of Triton's compiler turned into a KernelCompileError
    naming the kernel, head dim and config (a raw PTXASError names none of them)."""
    try:
        return run(config)
    except Exception as e:
        if not is_compile_failure(e):
            raise
        from ..errors import KernelCompileError
        raise KernelCompileError(compile_failure_message(kernel, problem, dtype, direction,
                                                         config, e)) from e


def first_that_runs(kernel, problem, dtype, direction: str, kept, run) -> dict:
    """Untimed choice (ATTNCC_TUNE=0): the first candidate that compiles within the GPU's
    resources (a variant reading tensors in its score may need more shared memory than
    the favourite tile allows). Each one skipped is reported; the choice is remembered
    for this process."""
    mem_key = (kernel.key, "untuned", direction, problem.dim, str(dtype), problem.group)
    if mem_key in _MEMORY:
        return _MEMORY[mem_key]
    import triton
    for config in kept():
        try:
            run(config)  # compiles it; the launch repeats the call's own work once
        except triton.runtime.errors.OutOfResources as e:
            log.info("%s %s: %s does not fit (%s); trying the next candidate",
                     kernel.variant.name, direction, configs.label(config), str(e).splitlines()[0][:100])
            continue
        except Exception as e:
            if not is_compile_failure(e):
                raise
            log.info("%s %s: %s failed to compile (%s: %s); trying the next candidate",
                     kernel.variant.name, direction, configs.label(config), type(e).__name__,
                     str(e).strip().splitlines()[0][:100] if str(e).strip() else "")
            continue
        _MEMORY[mem_key] = config
        return config
    raise RuntimeError(f"attncc: no tile config fits or compiles for {kernel.variant.name} "
                       f"({direction}, head dim {problem.dim}); pin a smaller one with "
                       "ATTNCC_CONFIG")


def tune(name: str, key: str, candidates: list, run, context: str = "") -> dict:
    """Time each config (median of do_bench), report progress, return the fastest."""
    import triton
    if context:
        key = f"{key} ({context})"
    start = time.perf_counter()
    # Compile them all at once before timing any (runtime/precompile.py).
    precompile.launch_together([lambda config=config: run(config) for config in candidates])
    timings = []
    for i, config in enumerate(candidates):
        label = configs.label(config)
        try:
            # do_bench's default windows, as the benchmarks use: 20 ms windows favoured
            # 64x32 forward tiles over what longer ones and steady calls measured, and
            # picked them at d = 0.125, 9% slower there (RESULTS.md runs 72-74).
            ms = triton.testing.do_bench(lambda: run(config), warmup=TUNE_WARMUP_MS,
                                         rep=TUNE_REP_MS, return_mode="median")
        except Exception as e:  # out of resources, compile failure: skip, and say so
            log.info("tuning %s %s: [%d/%d] %s failed (%s: %s)", name, key, i + 1, len(candidates),
                     label, type(e).__name__, str(e).splitlines()[0][:100])
            continue
        timings.append((ms, config))
        log.info("tuning %s %s: [%d/%d] %s %.3f ms", name, key, i + 1, len(candidates), label, ms)
    if not timings:
        raise RuntimeError(f"attncc: no tile config could run {name} ({key}); "
                           "pin one with ATTNCC_CONFIG to see its error")
    ms, best = min(timings, key=lambda t: t[0])
    log.info("tuned %s %s in %.1f s: %s (%.3f ms)", name, key, time.perf_counter() - start,
             configs.describe(best), ms)
    return dict(best)
