"""Autotuning and its on-disk cache: which backend and tile config (a Choice) run each
kernel role of a call.

The backend is one more dimension of the candidates: where several backends can run a
role (backends/__init__.py's registry, runtime/dispatch.py), the tuner times each one's
first candidates on the real inputs and keeps the fastest pair. On a GPU the first call
of a variant for a (role, head dim, dtype, length bucket, backends that can run it) does
this, keeps the fastest, and writes it to disk keyed by the variant, GPU, Triton and
attncc versions, so a second process does no tuning. Configs that fail to compile or
launch are skipped, never silently used. On a GPU attncc ships measured winners for
(runtime/known_winners.py), the first call runs the winner for the variant's class instead
of tuning (`ATTNCC_TUNE=full` tunes). `ATTNCC_CONFIG` (JSON) or `attncc.compile(...,
config=...)` pins a config; `ATTNCC_TUNE=0` takes the first candidate that runs, on the
portable kernels where others could run too (no backend is preferred untimed).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass

from .. import backends, ir
from ..backends.base import KERNEL_NAMES
from ..backends.tile_config import EXAMPLE, TileConfig
from ..errors import KernelFaultError, SettingError, is_kernel_fault
from . import configs, known_winners, precompile, settings
from .configs import density_bucket, length_bucket  # noqa: F401 - tuning keys use them

# Candidates timed per key and backend: compiles dominate cold-start time.
# ATTNCC_TUNE_CANDIDATES raises it (to search more widely once; the winner is cached
# either way).
def _candidates_setting() -> int:
    text = os.environ.get("ATTNCC_TUNE_CANDIDATES", "4")
    if not text.strip().isdigit() or int(text) < 1:
        settings.refuse_setting(f"ATTNCC_TUNE_CANDIDATES={text!r}: expected a whole number of "
                                "tile configs to time per tuning key, at least 1 (default 4)")
        return 4
    return int(text)


TUNE_AT_MOST = _candidates_setting()
TUNE_WARMUP_MS, TUNE_REP_MS = 25, 100  # per candidate; do_bench's own defaults
# Under the interpreter nothing is timed, and small tiles keep it fast.
INTERPRETER_CONFIG = TileConfig(16, 16, 4, 1)
_MEMORY: dict = {}  # (kernel key, tuning key) -> Choice, for this process
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
        raise SettingError(f"ATTNCC_TUNE={mode!r} is not a tuning mode; use "
                           + "; ".join(f"{m} ({what})" for m, what in TUNE_MODES.items()))
    return mode


# Checked at import too, as the runtime's other settings are (settings.py): under the
# interpreter no call tunes, so an unknown value would otherwise pass unseen.
try:
    tune_mode()
except SettingError as err:
    settings.refuse_setting(str(err))


@dataclass(frozen=True)
class Choice:
    """What runs one kernel role of a call: a backend, by name, and its tile config. The
    tuning cache stores it as {"backend": name, "config": {BLOCK_M, ...}}."""
    backend: str
    config: TileConfig

    @classmethod
    def from_json(cls, data, where: str) -> "Choice":
        """A stored choice, checked (a ValueError naming `where` on a bad one)."""
        if not isinstance(data, dict) or set(data) != {"backend", "config"}:
            raise ValueError(f"{where}: an entry must be {{\"backend\": ..., \"config\": "
                             f"{{...}}}}, got {data!r}")
        if data["backend"] not in backends.names():
            raise ValueError(f"{where}: {data['backend']!r} is not a backend; the backends are "
                             f"{', '.join(backends.names())}")
        return cls(data["backend"], TileConfig.from_dict(data["config"], where))

    def to_json(self) -> dict:
        return {"backend": self.backend, "config": self.config.as_dict()}

    def label(self) -> str:
        return f"{self.backend} {self.config.label()}"


def launcher(entry, *args, **kwargs):
    """run(config) for `entry`, a generated module's function: the one place a TileConfig
    becomes the dict the generated modules take."""
    return lambda config: entry(*args, config=config.as_dict(), **kwargs)


def _versions() -> str:
    import torch
    import triton
    from ..version import __version__
    gpu = torch.cuda.get_device_name().replace(" ", "_") if torch.cuda.is_available() else "cpu"
    return f"{gpu}-triton{triton.__version__}-torch{torch.__version__.split('+')[0]}-attncc{__version__}"


def _cache_file(variant: ir.Variant, suffix: str = "-choices"):
    """The variant's tuning file: "-choices", its Choices (a file of configs alone, as
    attncc kept before the backend was tuned too, has another name and is never read);
    decoding keeps its configs in a file of its own, "-decode" (attncc/runtime/decoding.py)."""
    from .cache import cache_dir
    return (cache_dir() / "tuning" / _versions()
            / f"{variant.short_name}-{variant.key()}{suffix}.json")


def _raw(path, parse) -> dict:
    """The file's entries that `parse(entry, where)` accepts (it raises ValueError on a
    bad one), as stored: {} when the file is missing or damaged; a damaged entry is
    skipped, but the others are kept."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    kept = {}
    for key, entry in data.items():
        try:
            parse(entry, str(path))
        except (ValueError, TypeError, KeyError):
            continue
        kept[key] = entry
    return kept


def _load(path, parse=Choice.from_json) -> dict:
    """The cached winners, parsed (_raw's). Whether one suits its call is checked where
    it is used (configs.usable)."""
    return {key: parse(entry, str(path)) for key, entry in _raw(path, parse).items()}


def _store(path, entries: dict, parse=Choice.from_json):
    """Add winners ({key: entry as stored}); a damaged entry already there is dropped. The
    read-modify-write holds an exclusive lock on a file beside the cache file (filelock:
    fcntl on POSIX, msvcrt on Windows), so processes tuning at once keep each other's
    entries (readers need no lock: every write is an atomic replace)."""
    from filelock import FileLock
    from .cache import write_if_changed
    path.parent.mkdir(parents=True, exist_ok=True)
    with _LOCK, FileLock(path.with_name(path.name + ".lock")):
        data = _raw(path, parse)
        data.update(entries)
        write_if_changed(path, json.dumps(data, indent=1, sort_keys=True) + "\n")


def pinned_config(kernel, backend: str, direction: str) -> TileConfig | None:
    """The config pinned for `backend`'s kernel of `direction`, if any. config= pins the
    kernels of the backend asked for: every portable kernel under backend="auto" or the
    portable one's name (auto then runs no other: runtime/dispatch.py); under another
    backend's name, its forward (its backward kernels take other tiles, and are tuned).
    ATTNCC_CONFIG pins the portable kernels."""
    portable = backends.portable().name
    requested = getattr(kernel, "requested_backend", "auto")
    if kernel.pinned_config is not None:
        if backend == portable and requested in ("auto", portable):
            return kernel.pinned_config  # checked when the kernel was compiled
        if backend == requested != portable and direction == "fwd":
            return kernel.pinned_config
    if backend != portable:
        return None
    pinned = configs.env_config()
    return configs.check_pinned(pinned, kernel.variant, "ATTNCC_CONFIG") if pinned else None


def _pinned_choice(kernel, options: tuple, direction: str):
    for backend in options:
        pinned = pinned_config(kernel, backend, direction)
        if pinned is not None:
            return Choice(backend, pinned)
    return None


def _kept(kernel, backend: str, head_dim: int, direction: str) -> list:
    return backends.named(backend).candidates(direction, head_dim, kernel.variant)


def choose(kernel, problem, dtype, direction: str, runs: dict, context=None, density=None,
           shape_density=None) -> Choice:
    """The Choice for this call of role `direction`: which of `runs` ({backend name:
    run(config)}, in order of preference: runtime/dispatch.py's Role) runs it, at which
    config. Every call of a kernel comes here (three times per forward + backward), so a
    choice made earlier in this process is found before any candidate is listed.
    `context()`, called only when tuning, says what the tuning ran on beyond the key
    (a runtime layout's density), for the progress lines. `density`: the tile density
    of kept tables (known without a sync in the call); choices are then tuned per
    density bucket, since few tiles per row want shorter pipelines (RESULTS.md run 38).
    `shape_density()`: this call's tile density, for the shipped winners' class (computed
    only when this GPU has shipped winners)."""
    options = tuple(runs)
    pinned = _pinned_choice(kernel, options, direction)
    if pinned is not None:
        return pinned
    from .settings import interpreting
    if interpreting():
        return Choice(untimed_backend(options), INTERPRETER_CONFIG)
    if tune_mode() == "0":
        backend = untimed_backend(options)
        kept = lambda: _kept(kernel, backend, problem.tile_dim, direction)
        return Choice(backend, first_that_runs(kernel, problem, dtype, direction, kept,
                                               runs[backend], backend))
    choice, _ = untimed_choice(kernel, problem, dtype, direction, options, density,
                               shape_density)
    if choice is not None:
        return choice
    return _tune(kernel, problem, dtype, direction, runs, context, density, shape_density)


def untimed_reason() -> str | None:
    """Why nothing is timed in this process, where nothing is: choose() then takes
    untimed_backend's."""
    from .settings import interpreting
    if interpreting():
        return "the Triton interpreter times nothing"
    return "ATTNCC_TUNE=0 times nothing" if tune_mode() == "0" else None


def untimed_backend(options: tuple) -> str:
    """The backend that runs where nothing is timed: the last of the options, the one
    that runs everywhere where several could (another backend is taken only where it
    was measured faster, by the tuner here or for the shipped winners)."""
    return options[-1]


def config_for(kernel, problem, dtype, direction: str, run=None, context=None,
               density=None, shape_density=None) -> TileConfig:
    """The portable kernel's config for this call: choose() with the portable backend
    alone, `run(config)` launching it. Without `run`, the config it would run untuned
    (ATTNCC_TUNE=0's first candidate), as `attncc compile` reports it."""
    portable = backends.portable().name
    if run is None:
        from .settings import interpreting
        pinned = pinned_config(kernel, portable, direction)
        if pinned is not None:
            return pinned
        return INTERPRETER_CONFIG if interpreting() else _kept(kernel, portable, problem.tile_dim,
                                                               direction)[0]
    return choose(kernel, problem, dtype, direction, {portable: run}, context, density,
                  shape_density).config


def untimed_choice(kernel, problem, dtype, direction: str, options: tuple, density=None,
                   shape_density=None):
    """(choice, new) where choosing among `options` (backend names) needs no timing: chosen
    earlier in this process (new False), or read from the tuning cache or the shipped
    winners (new True: this process has not launched it yet, so its first launch
    compiles). (None, False) where it must be tuned, and for pinned or untuned choices
    (choose()'s own)."""
    from .settings import interpreting
    if _pinned_choice(kernel, options, direction) or interpreting() or tune_mode() == "0":
        return None, False
    key = tuning_key(direction, problem, dtype, density, options)
    mem_key = (kernel.key, key)
    if mem_key in _MEMORY:
        return _MEMORY[mem_key], False
    cached = _load(_cache_file(kernel.variant)).get(key)
    if cached is not None and cached.backend in options and configs.usable(
            cached.backend, cached.config, kernel.variant, problem.tile_dim, direction):
        _MEMORY[mem_key] = cached
        return cached, True
    shipped = _shipped(kernel, problem, dtype, direction, options, density, shape_density)
    if shipped is not None and len(shipped) == 1:
        (backend, config), = shipped.items()
        if config is not None:  # no candidate compiled or timed: cold start is one compile
            choice = Choice(backend, config)
            log.info("%s %s: %s, the shipped winner for its class (ATTNCC_TUNE=full tunes "
                     "instead)", kernel.variant.name, key, choice.label())
            _MEMORY[mem_key] = choice
            return choice, True
    return None, False


def tuning_key(direction: str, problem, dtype, density=None, options: tuple = ()) -> str:
    """What calls share a choice by: the role, head dim, dtype, GQA group, length buckets,
    kept tables' density bucket, and the backends that could run it ("-on-NAME+triton":
    a call only one of them takes is another question, with its own answer)."""
    dims = f"d{problem.dim}" + (f"v{problem.dim_v}" if problem.dim_v != problem.dim else "")
    key = (f"{direction}-{dims}-{str(dtype).replace('torch.', '')}-g{problem.group}"
           f"-q{length_bucket(problem.len_q)}-k{length_bucket(problem.len_k)}")
    if density is not None:
        key += f"-density{density_bucket(density)}"
    return key + (f"-on-{'+'.join(options)}" if options else "")


def _call_density(density, shape_density):
    """The tile density the shipped winners' class is read at: kept tables' own, else the
    call's (None, so no shipped winner, where the caller cannot compute it)."""
    return (lambda: density) if density is not None else shape_density


def _shipped(kernel, problem, dtype, direction, options, density, shape_density):
    if tune_mode() == "full":
        return None
    return known_winners.shipped(kernel, problem, dtype, direction, options,
                                 _call_density(density, shape_density))


def _tune(kernel, problem, dtype, direction: str, runs: dict, context, density,
          shape_density) -> Choice:
    """Time the candidates of every backend in `runs` (each one's shipped config where the
    shipped winners name one, else its first TUNE_AT_MOST) and keep the fastest, in this
    process and on disk. Where several backends competed, each one's own fastest is kept
    too, under the key of a call only it can take."""
    options = tuple(runs)
    key = tuning_key(direction, problem, dtype, density, options)
    plan = (_shipped(kernel, problem, dtype, direction, options, density, shape_density)
            or dict.fromkeys(options))
    candidates = []
    for backend, config in plan.items():
        kept = [config] if config is not None else _kept(kernel, backend, problem.tile_dim,
                                                         direction)[:TUNE_AT_MOST]
        candidates += [Choice(backend, c) for c in kept]
    shown = f"{key} ({context()})" if context else key
    start = time.perf_counter()
    timings = time_candidates(kernel.variant.name, shown, candidates,
                              lambda choice: runs[choice.backend](choice.config), Choice.label)
    best = _fastest(kernel.variant.name, shown, timings, start, Choice.label)
    winners = {key: best}
    if len(options) > 1:
        for backend, config in plan.items():
            own = [t for t in timings if t[1].backend == backend]
            if config is None and own:  # tuned over its own candidates, not a shipped one
                winners[tuning_key(direction, problem, dtype, density, (backend,))] = \
                    min(own, key=lambda t: t[0])[1]
    for k, choice in winners.items():
        _MEMORY[(kernel.key, k)] = choice
    path = _cache_file(kernel.variant)
    try:
        _store(path, {k: choice.to_json() for k, choice in winners.items()})
    except OSError as e:
        from ..errors import CacheError
        from .cache import cache_unwritable
        raise CacheError(cache_unwritable(path, e)) from None
    return best


def is_compile_failure(error: Exception) -> bool:
    """Whether Triton's compiler failed on the kernel (ptxas crashing or refusing it, or
    the front end), as opposed to a launch that does not fit or an error of the call."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import PTXASError
    return isinstance(error, (PTXASError, CompilationError))


def compile_failure_message(kernel, problem, dtype, direction: str, config: TileConfig,
                            error: Exception) -> str:
    import triton
    cause = next((line.strip() for line in str(error).splitlines() if line.strip()), "")
    return (f"Triton {triton.__version__} could not compile the {KERNEL_NAMES.get(direction, direction)} "
            f"kernel of '{kernel.variant.name}' at head dim {problem.dim} "
            f"({str(dtype).replace('torch.', '')}) with the tile config {config.describe()} "
            f"({type(error).__name__}: {cause[:300]}). attncc keeps configs known to crash the "
            "compiler out of its candidates (backends/portable/tiles.py, keep()); to run now, "
            "pin another config with ATTNCC_CONFIG='{\"BLOCK_M\": 64, \"BLOCK_N\": 64, "
            "\"num_warps\": 4, \"num_stages\": 3}' (or attncc.compile(..., config=...)), or "
            "retune with ATTNCC_TUNE=full, and please report the variant, head dim, dtype and "
            "config")


def launch(kernel, problem, dtype, direction: str, run, config: TileConfig):
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


def first_that_runs(kernel, problem, dtype, direction: str, kept, run,
                    backend: str | None = None) -> TileConfig:
    """Untimed choice (ATTNCC_TUNE=0): the first of `kept()` (`backend`'s candidates)
    that compiles within the GPU's resources (a variant reading tensors in its score may
    need more shared memory than the favourite tile allows). Each one skipped is
    reported; the choice is remembered for this process."""
    mem_key = (kernel.key, "untuned", backend, direction, problem.dim, problem.dim_v, str(dtype),
               problem.group)
    if mem_key in _MEMORY:
        return _MEMORY[mem_key]
    import triton
    for config in kept():
        try:
            run(config)  # compiles it; the launch repeats the call's own work once
        except triton.runtime.errors.OutOfResources as e:
            log.info("%s %s: %s does not fit (%s); trying the next candidate",
                     kernel.variant.name, direction, config.label(), str(e).splitlines()[0][:100])
            continue
        except Exception as e:
            if is_kernel_fault(e):
                raise KernelFaultError(kernel_fault_message(
                    f"running {kernel.variant.name}'s {direction} at {config.label()}", e)) from e
            if not is_compile_failure(e):
                raise
            log.info("%s %s: %s failed to compile (%s: %s); trying the next candidate",
                     kernel.variant.name, direction, config.label(), type(e).__name__,
                     str(e).strip().splitlines()[0][:100] if str(e).strip() else "")
            continue
        _MEMORY[mem_key] = config
        return config
    raise RuntimeError(f"attncc: no tile config fits or compiles for {kernel.variant.name} "
                       f"({direction}, head dim {problem.dim}); pin a smaller one with "
                       f"ATTNCC_CONFIG={EXAMPLE!r}")


def kernel_fault_message(where: str, e: BaseException) -> str:
    """What a KernelFaultError says: where the fault surfaced (CUDA reports it at a later
    call than the launch that faulted, unless launches block), the CUDA error, and the
    ways around it."""
    first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
    return (f"attncc: a GPU kernel faulted ({first}); it surfaced while {where}, and the "
            "fault may be that kernel's or an earlier launch's. The CUDA context is now "
            "unusable: no later launch in this process can run. This is a bug in attncc's "
            "kernels, please report it with the variant and shapes; CUDA_LAUNCH_BLOCKING=1 "
            "names the faulting launch. Meanwhile pin another tile config (config= or "
            "ATTNCC_CONFIG), run backend='triton', or for a variant with tile tables keep "
            "ATTNCC_BACKWARD=one-launch")


def tune(name: str, key: str, candidates: list, run, context: str = "",
         label=lambda candidate: candidate.label()):
    """Time each candidate (median of do_bench), report progress, return the fastest.
    `label(candidate)`: how progress lines write one."""
    if context:
        key = f"{key} ({context})"
    start = time.perf_counter()
    return _fastest(name, key, time_candidates(name, key, candidates, run, label), start, label)


def time_candidates(name: str, key: str, candidates: list, run, label) -> list:
    """[(ms, candidate)] of the candidates that ran, each timed with `run(candidate)`; one
    that fails (out of resources, a compile failure) is skipped, and the log says so."""
    import triton
    # Compile them all at once before timing any (runtime/precompile.py).
    precompile.launch_together([lambda c=c: run(c) for c in candidates])
    timings = []
    for i, candidate in enumerate(candidates):
        text = label(candidate)
        try:
            # do_bench's default windows, as the benchmarks use: 20 ms windows favoured
            # 64x32 forward tiles over what longer ones and steady calls measured, and
            # picked them at d = 0.125, 9% slower there (RESULTS.md runs 72-74).
            ms = triton.testing.do_bench(lambda: run(candidate), warmup=TUNE_WARMUP_MS,
                                         rep=TUNE_REP_MS, return_mode="median")
        except Exception as e:  # out of resources, compile failure: skip, and say so
            if is_kernel_fault(e):  # no later candidate could run: say so now
                raise KernelFaultError(kernel_fault_message(
                    f"tuning {name} ({key}), {text} (candidate {i + 1} of {len(candidates)}; "
                    "all were launched once before timing)", e)) from e
            log.info("tuning %s %s: [%d/%d] %s failed (%s: %s)", name, key, i + 1, len(candidates),
                     text, type(e).__name__, str(e).splitlines()[0][:100])
            continue
        timings.append((ms, candidate))
        log.info("tuning %s %s: [%d/%d] %s %.3f ms", name, key, i + 1, len(candidates), text, ms)
    return timings


def _fastest(name: str, key: str, timings: list, start: float, label):
    if not timings:
        raise RuntimeError(f"attncc: no tile config could run {name} ({key}); "
                           "pin one with ATTNCC_CONFIG to see its error")
    ms, best = min(timings, key=lambda t: t[0])
    log.info("tuned %s %s in %.1f s: %s (%.3f ms)", name, key, time.perf_counter() - start,
             label(best), ms)
    return best
