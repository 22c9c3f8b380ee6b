"""Generated modules define only the helpers they call (codegen/helpers.py), and every
helper they call is defined."""
import re

import pytest

import attncc
from attncc.codegen import helpers
from attncc.backends.portable import codegen as portable

SPECS = {
    "causal": "attention a { mask q >= k }",
    "softcap": "attention a { mask q >= k score 30.0 * tanh(s / 30.0) }",
    "dropout": "attention a { mask q >= k dropout 0.1 }",
    "chance": "attention a { param seed: int = 3 layout chance(0.3, seed, h, qb, kb) or qb == kb block 32 }",
    "divmod": "attention a { mask q // 128 == k // 128 and (q % 7) < 5 }",
    "index_list": "attention a { input t: i32[h, qb, 2] layout kb in t[h, qb] block 32 }",
}


def defined(source: str) -> set:
    return set(re.findall(r"^def (\w+)\(", source, re.M))


@pytest.mark.parametrize("name, present, absent", [
    ("causal", set(), {"_tanh", "_chance_start", "_dropout_keep", "_fmix32", "_h_tile_in",
                       "_h_chance", "_mod", "_h_mod"}),
    ("softcap", {"_tanh"}, {"_chance_start", "_dropout_keep"}),
    ("dropout", {"_dropout_keep", "_dropout_keep_t", "_fmix32"}, {"_tanh", "_chance_start"}),
    ("chance", {"_chance_start", "_chance_step", "_chance_keep", "_fmix32", "_h_chance",
                "_h_fmix32"}, {"_dropout_keep", "_tanh"}),
    ("divmod", {"_mod", "_h_fdiv", "_h_mod"}, {"_tanh"}),
    ("index_list", {"_h_tile_in"}, {"_tanh", "_dropout_keep"}),
])
def test_a_module_defines_the_helpers_it_calls_and_no_others(name, present, absent):
    source = portable.generate(attncc.parse(SPECS[name])).source
    have = defined(source)
    assert present <= have, present - have
    assert not (absent & have), absent & have


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_helper_a_module_calls_is_defined(name):
    source = portable.generate(attncc.parse(SPECS[name])).source
    called = set(re.findall(r"(?<![\w.])(_\w+)\(", source))
    missing = {c for c in called & set(helpers.OPTIONAL) if c not in defined(source)}
    assert not missing
    aliases = re.findall(r"^\s+(.*) = .*# the kernels' helper names, on the host", source, re.M)
    for alias in (aliases[0].split(", ") if aliases else []):
        assert "_h" + alias in defined(source)
    compile(source, name, "exec")  # and it is Python
