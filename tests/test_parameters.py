"""codegen/parameters.py: the per-tile device functions of a generated module take only
the row and context parameters their code reads. The generator knows what they read
from the printers' reports and the templates' own reads (parameters.READS), without
reading the module; here the module is read: rendered with the full lists, the names no
function taking a list reads must be exactly the names the generator leaves out."""
import ast
import re
from pathlib import Path

import pytest

import attncc
from attncc.backends.portable import codegen as portable
from attncc.codegen import parameters

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.attn"))
SPECS = {
    "causal": "attention a { mask q >= k }",
    "score_reads_the_head": "attention a { input bias: f32[h] score s + bias[h] }",
    "dropout": "attention d { mask q >= k dropout 0.1 }",
    "learnable": "attention a { learnable input slope: f32[h] mask q >= k score s + slope[h] * (k - q) }",
    "learnable_per_pair": "attention a { learnable input t: f32[q, k] score s + t[q, k] }",
    "constant_score": "attention a { score 1.5 }",
    "index_list": "attention a { input t: i32[h, qb, 2] layout kb in t[h, qb] block 32 }",
    "layout_per_element": "attention a { input on: bool[b, qb, kb] layout on[b, qb, kb] block 16 }",
    "lengths": "attention a { mask q + len_k - len_q >= k score s * dim }",
}
CASES = [pytest.param(attncc.load, p, id=p.stem) for p in EXAMPLES] + [
    pytest.param(attncc.parse, text, id=name) for name, text in SPECS.items()]

# The functions of each family, which take the family's lists and hand them on.
FUNCTIONS = {
    "fwd": ("_fwd_step", "_fwd_tiles"),
    "dq": ("_dq_step", "_dq_tiles"),
    "dkdv": ("_dkdv_step", "_dkdv_tiles"),
    "decode": ("_decode_allowed", "_decode_step", "_decode_tiles"),
}
PASSING = {f for names in FUNCTIONS.values() for f in names}


class _Reads(ast.NodeVisitor):
    """Names a function reads, not counting the arguments it hands to PASSING functions."""

    def __init__(self):
        self.names: set = set()

    def visit_Name(self, node):
        self.names.add(node.id)

    def visit_Call(self, node):
        if isinstance(node.func, ast.Name) and node.func.id in PASSING:
            return  # handing the lists on is not reading them
        self.generic_visit(node)


def _functions(source: str) -> dict:
    return {node.name: node for node in ast.parse(source).body
            if isinstance(node, ast.FunctionDef) and node.name in PASSING}


def _params(f) -> set:
    return {a.arg for a in f.args.args
            if a.annotation is None or "constexpr" not in ast.unparse(a.annotation)}


def _reads(f) -> set:
    reads = _Reads()
    for statement in f.body:
        reads.visit(statement)
    return reads.names


def unread(source: str) -> dict:
    """For each template list, the parameters of every function taking it that none of
    those functions reads."""
    functions = _functions(source)
    out = {}
    for listed, families in parameters.USERS.items():
        users = [functions[f] for family in families for f in FUNCTIONS[family] if f in functions]
        out[listed] = set.intersection(*map(_params, users)) - set().union(*map(_reads, users))
    return out


@pytest.mark.parametrize("load, what", CASES)
def test_the_lists_leave_out_what_no_function_taking_them_reads(load, what):
    """Rendered with the full lists, then again without what that rendering's functions
    leave unread: the generated module, rendered once, is the same text."""
    variant = load(what)
    context = portable.template_context(variant)
    template = portable._environment().get_template("attention.py.jinja")
    full = template.render(**dict(context, unread={listed: frozenset() for listed in parameters.USERS}))
    again = re.sub(r"\n{4,}", "\n\n\n", template.render(**dict(context, unread=unread(full))))
    assert portable.generate(variant).source == again


@pytest.mark.parametrize("load, what", CASES)
def test_step_functions_take_only_what_they_read(load, what):
    """A step function's parameters are all read, except where the forward and the dQ
    steps share their context list (fwd_ctx): there, what one leaves unread the other
    reads (the dQ step's input-gradient pointers, the forward's nothing else)."""
    functions = _functions(portable.generate(load(what)).source)
    fwd, dq, dkdv = (functions[n] for n in ("_fwd_step", "_dq_step", "_dkdv_step"))
    unread_of = lambda f: _params(f) - _reads(f)
    assert unread_of(fwd) <= _reads(dq)
    assert unread_of(dq) <= _reads(fwd)
    assert not unread_of(dkdv)


def test_what_the_causal_variant_leaves_out():
    """The forward step reads neither the query tile's index nor the seed; a score that
    reads the head keeps it; dropout keeps the seed."""
    lists = portable.template_context(attncc.parse(SPECS["causal"]))["unread"]
    assert "tile_q" in lists["fwd_row"] and "offs_m" in lists["fwd_row"]
    assert "seed" in lists["fwd_ctx"] and "n_heads_q" in lists["fwd_ctx"]
    assert "q" not in lists["fwd_row"] and "qk_scale" not in lists["fwd_ctx"]
    for name, kept in (("score_reads_the_head", "off_h"), ("dropout", "seed")):
        assert kept not in portable.template_context(attncc.parse(SPECS[name]))["unread"]["fwd_ctx"]


def test_the_filter_keeps_order_and_drops_only_names_given():
    assert parameters.without("a, b, c , d", {"b", "d"}) == "a, c"
    assert parameters.without("a, b", frozenset()) == "a, b"
    assert parameters.without("a, b, c", parameters.Unread({"a", "c"})) == "a, c"
