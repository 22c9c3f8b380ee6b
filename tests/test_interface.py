"""The generated modules' contract (attncc/codegen/interface.py): every module keeps it, and
attncc uses no name of a generated module that the contract does not list."""
import re
from pathlib import Path

import pytest

import attncc
from attncc.codegen import interface
from attncc.runtime.cache import load_generated

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


@pytest.mark.parametrize("name,uses_tables", [("causal", False), ("document", True),
                                              ("bigbird", True), ("alibi", False),
                                              ("relative_bias", False)])
def test_a_portable_module_keeps_the_contract(name, uses_tables):
    variant = attncc.load(EXAMPLES / f"{name}.attn")
    gen, module = load_generated(variant)
    assert module.USES_TABLES is uses_tables
    learnable = bool(variant.learnable_inputs)
    assert interface.missing(module, uses_tables, learnable=learnable) == []
    assert hasattr(module, "atomic_reads") == learnable  # only where there is something to add
    if not uses_tables:  # one launch is a table-driven module's alone
        assert not hasattr(module, "backward_one_launch")


def test_the_gluon_module_keeps_the_contract():
    gen, module = load_generated(attncc.load(EXAMPLES / "causal.attn"), "gluon")
    assert interface.missing(module, False, backend="gluon", fused=True) == []
    # The fused backward only where it takes the variant: softmax, no learnable inputs.
    for name in ("relative_bias", "sigmoid_attention"):
        gen, module = load_generated(attncc.load(EXAMPLES / f"{name}.attn"), "gluon")
        assert interface.missing(module, False, backend="gluon") == []
        assert not hasattr(module, "backward_fused") and "attn_bwd_fused" not in gen.source


def test_attncc_uses_only_the_contracts_names():
    # Every `module.NAME`, `kernel.module.NAME` and the Gluon template's `host.NAME`.
    used = set()
    sources = list((ROOT / "attncc").rglob("*.py")) + list((ROOT / "attncc").rglob("*.jinja"))
    for path in sources:
        used |= set(re.findall(r"\b(?:module|host)\.([A-Za-z_]\w*)", path.read_text()))
    allowed = (set(interface.PORTABLE) | set(interface.PORTABLE_WITH_TABLES)
               | set(interface.PORTABLE_WITH_LEARNABLE) | set(interface.GLUON))
    # Python's own attributes of any module.
    allowed |= {"__file__", "__name__", "__dict__"}
    assert used - allowed == set()
