"""runtime/precompile.py: launches meant to compile run at the same time, on the caller's
device and stream, and never during a CUDA graph capture. (On the GPU, RESULTS.md
run 88 times what it saves; here CUDA is stood in for.)"""
import contextlib
import threading

import pytest
import torch

import attncc
from attncc.runtime import precompile


@pytest.fixture
def fake_cuda(monkeypatch):
    state = {"capturing": False, "entered": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: "the caller's stream")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])

    @contextlib.contextmanager
    def device(d):
        state["entered"].append(("device", d, threading.current_thread().name))
        yield

    @contextlib.contextmanager
    def stream(s):
        state["entered"].append(("stream", s, threading.current_thread().name))
        yield

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    return state


def test_launches_run_at_the_same_time_on_the_callers_device_and_stream(fake_cuda, monkeypatch):
    monkeypatch.setattr(precompile.os, "cpu_count", lambda: 16)  # threads: one per core
    n = 4
    barrier = threading.Barrier(n, timeout=10)  # passes only if all four wait together
    met = []
    precompile.launch_together([lambda: met.append(barrier.wait()) for _ in range(n)])
    assert sorted(met) == list(range(n))
    workers = {name for _, _, name in fake_cuda["entered"]}
    assert threading.current_thread().name not in workers
    assert {(kind, what) for kind, what, _ in fake_cuda["entered"]} == {
        ("device", 3), ("stream", "the caller's stream")}


def test_a_failing_launch_is_left_for_the_real_one(fake_cuda):
    ran = []

    def does_not_fit():
        raise RuntimeError("out of resources")

    precompile.launch_together([does_not_fit, lambda: ran.append(1)])
    assert ran == [1]


def test_nothing_runs_while_a_graph_is_captured(fake_cuda):
    fake_cuda["capturing"] = True
    ran = []
    precompile.launch_together([lambda: ran.append(1), lambda: ran.append(2)])
    assert ran == []


def test_one_launch_or_no_gpu_is_left_alone(fake_cuda, monkeypatch):
    ran = []
    precompile.launch_together([lambda: ran.append(1)])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    precompile.launch_together([lambda: ran.append(2), lambda: ran.append(3)])
    assert ran == []


# ------------------------------------------------------------------ on the GPU
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="speculative launches are made on CUDA tensors only")


@needs_gpu
@pytest.mark.parametrize("spec", [
    "attention spec_causal { mask q >= k }",  # dQ and dK/dV: two backward kernels
    # tile tables: the delta pass and the one-launch backward
    "attention spec_doc { input doc: i32[q] input doc_k: i32[k] mask doc[q] == doc_k[k] }",
])
def test_a_first_call_compiling_its_backward_beside_its_forward_is_exact(spec, monkeypatch):
    # A first call with winners known without timing (stood in for here: every direction's
    # first candidate, portable forward) launches the backward on stand-in tensors beside
    # its forward; the results must be those of the float64 reference all the same.
    from attncc import backends
    from attncc.runtime import known_winners, tuning
    from test_kernels import compare

    monkeypatch.delenv("ATTNCC_TUNE", raising=False)
    monkeypatch.setattr(tuning, "_MEMORY", {})

    def winner(kernel, problem, dtype, direction, options, density):
        portable = backends.portable()
        return {portable.name: portable.candidates(direction, problem.dim, kernel.variant)[0]}

    monkeypatch.setattr(known_winners, "shipped", winner)
    batches = []
    real = precompile.launch_together
    monkeypatch.setattr(precompile, "launch_together",
                        lambda runs: (batches.append(len(runs)), real(runs)))
    variant = attncc.parse(spec)
    compare(variant, B=2, H=3, Lq=200, Lk=333, D=64, dtype=torch.float16)
    assert batches and batches[0] == 3, batches  # forward + dQ + dK/dV, or + delta + one launch


def test_the_first_launch_waits_for_tritons_key_thread(monkeypatch):
    """warm_triton_in_background starts Triton's key hashing once per process, and
    wait_for_triton (called before a forward or decode launch) joins it, so that the
    first launch's compile threads find the key computed instead of each hashing it."""
    import threading
    from attncc.runtime import precompile
    started, release = threading.Event(), threading.Event()

    def slow_key():
        started.set()
        release.wait(5)
    import triton.runtime.cache
    monkeypatch.setattr(triton.runtime.cache, "triton_key", slow_key)
    monkeypatch.setattr(precompile, "_triton_warmed", threading.Event())
    monkeypatch.setattr(precompile, "_key_thread", None)
    precompile.warm_triton_in_background()
    precompile.warm_triton_in_background()  # once per process
    assert started.wait(5)
    thread = precompile._key_thread
    assert thread.is_alive()
    threading.Timer(0.2, release.set).start()
    precompile.wait_for_triton()
    assert not thread.is_alive() and precompile._key_thread is None
    precompile.wait_for_triton()  # nothing left to wait for
