"""Backends as plug-ins: a backend registered in attncc/backends/__init__.py's registry is
found by the runtime, the tuner and `attncc compile` through the protocol alone. Here a
stand-in third backend, whose module is the portable one renamed and which counts its
launches, is registered for a test and used with no other edit."""
import dataclasses
import re
from pathlib import Path

import pytest
import torch

import attncc
from attncc import backends
from attncc.backends.base import ENTRY_POINTS
from attncc.backends.tile_config import TileConfig
from attncc.codegen.generated import module_name
from attncc.runtime import tuning
from attncc.tools.cli import main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CAUSAL = str(EXAMPLES / "causal.attn")


class Stand:
    """A third backend: the portable kernels under another name, able everywhere."""
    name = "stand"
    title = "Stand-in"
    auto_reason = "the stand-in backend runs everywhere"
    module_note = "the portable kernels, renamed"
    forced_note = "forward, dQ and dK/dV anywhere"
    auto_note = "forward, dQ and dK/dV where the tuner times them faster than the portable ones"

    def __init__(self):
        self.launched = []  # the roles launched through it

    def environment_unsupported(self):
        return None

    def supports(self, variant):
        return "a dropout stand-in is not written" if variant.dropout else None

    def supports_call(self, variant, q, k, v, kind):
        return None if kind in ("fwd", "dq", "dkdv") else "it has no one-launch backward"

    def render(self, variant):
        gen = backends.portable().render(variant)
        return dataclasses.replace(gen, module_name=module_name(variant, self.name))

    def candidates(self, direction, head_dim, variant):
        return backends.portable().candidates(direction, head_dim, variant)

    def check_config(self, config, direction, head_dim):
        return None

    def entry(self, module, kind):
        fn = getattr(module, ENTRY_POINTS[kind])

        def launch(*args, **kwargs):
            self.launched.append(kind)
            return fn(*args, **kwargs)
        return launch


@pytest.fixture
def stand(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNCC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_MEMORY", {})
    backend = Stand()
    # One line of the registry: before the portable backend, after Gluon.
    monkeypatch.setattr(backends, "REGISTRY", (*backends.preferred(), backend,
                                               backends.portable()))
    return backend


def _qkv(dim=16, grad=False):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(1, 2, 24, dim, generator=gen, requires_grad=grad) for _ in range(3)]


def test_a_registered_backend_runs_when_asked_for_by_name(stand):
    kernel = attncc.compile(CAUSAL, backend="stand")
    assert kernel.backend == "stand" and kernel.backend_reason == "backend='stand' was asked for"
    assert re.match(r"attncc_stand_causal_", kernel.module_of("stand").__name__)
    q, k, v = _qkv(grad=True)
    out = kernel(q, k, v)
    out.sum().backward()
    assert stand.launched == ["fwd", "dq", "dkdv"]
    assert kernel.last_backend == ("stand", "backend='stand' was asked for (forward)")
    assert kernel.last_backward == {"dq": ("stand", "backend='stand' was asked for (dQ)"),
                                    "dkdv": ("stand", "backend='stand' was asked for (dK/dV)")}
    # Its kernels are the portable ones: the same results.
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    portable = attncc.compile(CAUSAL, backend="triton")
    portable(q2, k2, v2).sum().backward()
    assert torch.allclose(out, portable(q2, k2, v2), atol=1e-6)
    assert torch.allclose(q.grad, q2.grad, atol=1e-6)
    # What it cannot take is refused by name, with its own reason.
    with pytest.raises(attncc.BackendError, match="backend='stand' cannot run this: a dropout "
                                                  "stand-in is not written; use backend='auto'"):
        attncc.compile(str(EXAMPLES / "dropout.attn"), backend="stand")


def test_auto_runs_a_registered_backend_where_the_tuner_chose_it(stand, monkeypatch):
    kernel = attncc.compile(CAUSAL)  # Gluon cannot run under the interpreter; the stand-in can
    assert [b.name for b in kernel.backends] == ["stand", "triton"]
    assert kernel.backend == "stand" and kernel.backend_reason == Stand.auto_reason
    q, k, v = _qkv()
    kernel(q, k, v)  # the interpreter times nothing: the portable forward
    assert stand.launched == [] and kernel.last_backend[0] == "triton"
    assert "interpreter times nothing" in kernel.last_backend[1]
    # A choice the tuner made (here put in its memory) runs the backend it names.
    monkeypatch.setattr("attncc.runtime.settings.interpreting", lambda: False)
    problem = kernel.check_call(q, k, v, {}, 0, 0)
    key = tuning.tuning_key("fwd", problem, q.dtype, None, ("stand", "triton"))
    tuning._MEMORY[(kernel.key, key)] = tuning.Choice("stand", TileConfig(16, 16, 4, 1))
    kernel(q, k, v)
    assert stand.launched == ["fwd"]
    assert kernel.last_backend == ("stand", "the tuner measured the Stand-in forward faster "
                                            "for this shape")


def test_the_table_driven_backward_names_every_other_backend(stand, monkeypatch):
    from attncc.runtime import settings
    kernel = attncc.compile(str(EXAMPLES / "document.attn"), backend="stand")
    q, k, v = _qkv(grad=True)
    doc = torch.tensor([0] * 10 + [1] * 14, dtype=torch.int32)
    # ATTNCC_BACKWARD=auto (the default): a backend that takes dQ and dK/dV runs them.
    monkeypatch.setattr(settings, "TABLES_BACKWARD", "auto")
    kernel(q, k, v, doc_q=doc, doc_k=doc).sum().backward()
    assert stand.launched[-2:] == ["dq", "dkdv"] and "bwd" not in kernel.last_backward
    # The one portable launch, where asked for, says which backends would run them apart.
    monkeypatch.setattr(settings, "TABLES_BACKWARD", "one-launch")
    kernel(q, k, v, doc_q=doc, doc_k=doc).sum().backward()
    backend, why = kernel.last_backward["bwd"]
    assert backend == "triton" and "on the Gluon or Stand-in kernels where they can" in why


def test_the_cli_writes_a_registered_backends_module(stand, tmp_path, capsys):
    assert main(["compile", CAUSAL, "--backend", "stand", "-o", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "causal_stand.py").read_text() == stand.render(attncc.load(CAUSAL)).source
    assert "backend   stand forward, dQ and dK/dV anywhere" in out
    assert "Stand-in dQ tiles (head dim 128): 64x64 (4 warps, 2 stages)" in out


def test_context_parallel_pieces_run_the_chosen_backend_forward_and_backward(stand, tmp_path):
    """Each context-parallel piece pair runs the backend a single-device call of the pair
    would: the pieces' dQ and dK/dV too, not only their forward (they once called the
    portable module's entry points directly, so on Hopper the pieces' backward never ran
    the Gluon kernels)."""
    import torch.distributed as dist
    from attncc import distributed as cp
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0,
                            world_size=1)
    try:
        kernel = attncc.compile(CAUSAL, backend="stand")
        q, k, v = _qkv(grad=True)
        out = cp.context_parallel_attention(kernel, q, k, v)
        out.sum().backward()
        # zig-zag over one rank: two pieces, three causal pairs (the later piece's keys
        # come after the earlier piece's queries): every pair through the stand-in.
        assert stand.launched.count("fwd") == 3
        assert stand.launched.count("dq") == 3 and stand.launched.count("dkdv") == 3
        assert set(stand.launched) == {"fwd", "dq", "dkdv"}
        assert kernel.last_backward["dq"][0] == "stand"
    finally:
        dist.destroy_process_group()
