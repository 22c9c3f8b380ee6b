"""Compile several kernel configs at the same time, to shorten a variant's first call.

The first launch of a config compiles it, and compiling (Triton's MLIR passes, LLVM and
ptxas) takes 1-3 s per kernel, most of a cold start. Triton's compiler releases the GIL
for much of that work: four backward kernels compiled in four threads took 5.0 s where
one after another took 8.3 s, on two CPU cores (RESULTS.md run 87; a GPU host has more).
So where a call is about to compile several configs (the tuner's candidates, or the
backward's dQ and dK/dV kernels), each is launched once first, all at the same time;
what they compute is discarded, and the launches that follow find them compiled.

Each thread launches on the caller's device and stream, so its launch is ordered after
the work that produced its inputs. Nothing is done while a CUDA graph is being captured
(the launches would be captured too). An error (a config that does not fit) is left for
the real launch to raise, where the caller handles it as before.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

MAX_THREADS = 8
_triton_warmed = threading.Event()
_key_thread: threading.Thread | None = None


def launch_together(runs: list) -> None:
    """Call each `run()` once, in threads, and wait for all of them."""
    import torch
    if len(runs) < 2 or not torch.cuda.is_available() or torch.cuda.is_current_stream_capturing():
        return
    device, stream = torch.cuda.current_device(), torch.cuda.current_stream()

    def launch(run):
        try:
            with torch.cuda.device(device), torch.cuda.stream(stream):
                run()
        except Exception:  # noqa: BLE001 - the real launch raises it, and is handled there
            pass

    threads = min(len(runs), MAX_THREADS, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="attncc-compile") as pool:
        list(pool.map(launch, runs))


def warm_triton_in_background() -> None:
    """Start Triton's once-per-process work on a daemon thread: `triton_key()` imports
    Triton's compiler packages and hashes its sources and its 1 MB-chunked library for its
    compile-cache keys, about 0.36 s on an H100 host (RESULTS.md run 100), and the first
    launch of any kernel waits for it. Started when a variant is compiled, it runs while
    the generated modules load; `wait_for_triton()` before the first launch then finds
    it done, where the first launch's compile threads would each have hashed it again
    (its cache is not shared between threads in flight: run 101)."""
    global _key_thread
    if _triton_warmed.is_set():
        return
    _triton_warmed.set()
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # another Triton: its first launch does the work, as before
        return
    _key_thread = threading.Thread(target=triton_key, name="attncc-triton-key", daemon=True)
    _key_thread.start()


def wait_for_triton() -> None:
    """Before a launch: let the thread of warm_triton_in_background finish first."""
    global _key_thread
    thread = _key_thread
    if thread is not None:
        thread.join()
        _key_thread = None
