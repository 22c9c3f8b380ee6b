"""Generated modules define only the helpers they call (codegen/helpers.py), and every
helper they call is defined. The generators know what a module calls from the printers'
reports, without reading the module; here the module is read: rendered with every
helper, the helpers its code calls (outside their own definitions) must be exactly the
ones the generated module defines, for the portable and the Gluon backend alike."""
import re
from pathlib import Path

import pytest

import attncc
from attncc.backends.gluon import codegen as gluon
from attncc.backends.portable import codegen as portable
from attncc.codegen import helpers, templating

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.attn"))
SPECS = {
    "causal": "attention a { mask q >= k }",
    "softcap": "attention a { mask q >= k score 30.0 * tanh(s / 30.0) }",
    "dropout": "attention a { mask q >= k dropout 0.1 }",
    "chance": "attention a { param seed: int = 3 layout chance(0.3, seed, h, qb, kb) or qb == kb block 32 }",
    "chance_one_key": "attention a { layout chance(0.5, kb) block 32 }",
    "divmod": "attention a { mask q // 128 == k // 128 and (q % 7) < 5 }",
    "index_list": "attention a { input t: i32[h, qb, 2] layout kb in t[h, qb] block 32 }",
    "learnable": "attention a { learnable input slope: f32[h] mask q >= k score s + slope[h] * (k - q) }",
    "where_in_mask": "attention a { mask where(q > 8, q - k, k - q) < 4 }",
    "table_read": "attention a { input doc: i32[q] mask doc[q] == doc[k] and q >= k }",
    "host_where": "attention a { input on: bool[qb, kb] layout on[qb, kb] or abs(qb - kb) <= 1 block 16 "
                  "mask max(q - k, 0) < 40 }",
    "rounding": "attention a { input t: f32[h, 64] score s + t[h, min(max(floor(log(abs(q - k) + 1.0) * 8.0), 0), 63)] }",
}
CASES = [pytest.param(attncc.load, p, id=p.stem) for p in EXAMPLES] + [
    pytest.param(attncc.parse, text, id=name) for name, text in SPECS.items()]

TEMPLATES = [*portable.TEMPLATES.glob("*.jinja"), *gluon.TEMPLATES.glob("*.jinja"),
             *templating.SHARED_TEMPLATES.glob("*.jinja")]
# The helpers a module may leave out: those the templates define behind emit().
OPTIONAL = sorted({name for t in TEMPLATES for name in re.findall(r'emit\("(\w+)"\)', t.read_text())})
ALIAS_MARK = "# the kernels' helper names, on the host"


def defined(source: str) -> set:
    return set(re.findall(r"^def (\w+)\(", source, re.M))


def _definition(source: str, name: str) -> str:
    """The text of `def name(...)`'s block (decorator included), or ''."""
    match = re.search(rf"^(@triton\.jit\n)?def {name}\(.*?(?=^\S)", source + "\nEND",
                      re.MULTILINE | re.DOTALL)
    return match.group(0) if match else ""


def _calls(text: str) -> set:
    return {name for name in OPTIONAL if re.search(rf"\b{name}\b", text)}


def called(source: str) -> tuple[set, tuple]:
    """(optional helpers, host aliases) that `source`, rendered with every helper, calls:
    its code outside those helpers' definitions, and the helpers they call in turn."""
    definitions = {name: _definition(source, name) for name in OPTIONAL}
    outside = source
    for text in definitions.values():
        if text:
            outside = outside.replace(text, "")
    outside = "\n".join(line for line in outside.splitlines() if ALIAS_MARK not in line)
    tables = _definition(outside, "tile_tables")
    aliases = tuple(name for name in helpers.HOST_ALIASES if re.search(rf"\b{name}\(", tables))
    # In tile_tables a kernel helper's name is bound to the host's helper (the alias line):
    # a call of it there calls the host helper, not the kernels'.
    used = (_calls(outside.replace(tables, "")) | (_calls(tables) - set(aliases))
            | {helpers.host_helper(name) for name in aliases})
    while True:
        more = set().union(*(_calls(definitions[name]) for name in used)) - used
        if not more:
            return used, aliases
        used |= more


def _full_portable(variant) -> str:
    context = dict(portable.template_context(variant), emit=lambda name: True,
                   host_aliases=helpers.HOST_ALIASES)
    return portable._environment().get_template("attention.py.jinja").render(**context)


def _full_gluon(variant) -> str:
    context = dict(gluon.template_context(variant), emit=lambda name: True)
    return templating.environment(gluon.TEMPLATES).get_template(
        "attention_gluon.py.jinja").render(**context)


@pytest.mark.parametrize("load, what", CASES)
def test_a_portable_module_defines_what_its_full_rendering_calls(load, what):
    variant = load(what)
    source = portable.generate(variant).source
    want, aliases = called(_full_portable(variant))
    assert defined(source) & set(OPTIONAL) == want
    bound = re.findall(rf"^\s+(.*) = .*{ALIAS_MARK}", source, re.M)
    assert tuple(bound[0].split(", ") if bound else ()) == aliases


@pytest.mark.parametrize("load, what", CASES)
def test_a_gluon_module_defines_what_its_full_rendering_calls(load, what):
    variant = load(what)
    want, _ = called(_full_gluon(variant))
    assert defined(gluon.generate(variant).source) & set(OPTIONAL) == want


@pytest.mark.parametrize("name, present, absent", [
    ("causal", set(), {"_tanh", "_chance_start", "_dropout_keep", "_fmix32", "_h_tile_in",
                       "_h_chance", "_mod", "_h_mod"}),
    ("softcap", {"_tanh"}, {"_chance_start", "_dropout_keep"}),
    ("dropout", {"_dropout_keep", "_dropout_keep_t", "_fmix32"}, {"_tanh", "_chance_start"}),
    ("chance", {"_chance_start", "_chance_step", "_chance_keep", "_fmix32", "_h_chance",
                "_h_fmix32"}, {"_dropout_keep", "_tanh"}),
    ("chance_one_key", {"_chance_start", "_chance_keep"}, {"_chance_step"}),
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
    for backend in (portable, gluon):
        source = backend.generate(attncc.parse(SPECS[name])).source
        calls = set(re.findall(r"(?<![\w.])(_\w+)\(", source))
        # tile_tables binds the kernels' helper names it calls to the host's (the alias line)
        bound = {name for line in re.findall(rf"^\s+(.*) = .*{ALIAS_MARK}", source, re.M)
                 for name in line.split(", ")}
        assert not {c for c in calls & set(OPTIONAL) if c not in defined(source) | bound}
        compile(source, name, "exec")  # and it is Python
