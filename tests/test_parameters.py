"""codegen/parameters.py: the per-tile device functions of a generated module take only
the row and context parameters their code reads, for every example, and the rendering
that drops the others is checked against the full one."""
import ast
from pathlib import Path

import pytest

import attncc
from attncc.codegen import parameters
from attncc.backends.portable import codegen as portable

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.attn"))


def _functions(source: str) -> dict:
    return {node.name: node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)}


def _reads(f) -> set:
    reads = parameters._Reads()
    for statement in f.body:
        reads.visit(statement)
    return reads.names


def _unread(f) -> set:
    return {a.arg for a in f.args.args if not parameters._is_constexpr(a)} - _reads(f)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_step_functions_take_only_what_they_read(path):
    """A step function's parameters are all read, except where the forward and the dQ
    steps share their context list (fwd_ctx): there, what one leaves unread the other
    reads (the dQ step's input-gradient pointers, the forward's nothing else)."""
    functions = _functions(portable.generate(attncc.load(path)).source)
    fwd, dq, dkdv = (functions[n] for n in ("_fwd_step", "_dq_step", "_dkdv_step"))
    assert _unread(fwd) <= _reads(dq), path.stem
    assert _unread(dq) <= _reads(fwd), path.stem
    assert not _unread(dkdv), path.stem


def test_what_is_dropped_is_what_no_user_reads():
    """On the full rendering of the causal variant: the forward step reads neither the
    query tile's index nor the seed, and the dQ step shares the forward's context, so
    what the context drops is read by neither."""
    variant = attncc.parse("attention causal { mask q >= k }")
    context = portable.template_context(variant)
    full = portable._environment().get_template("attention.py.jinja").render(**context)
    dropped = parameters.unread(full)
    assert {"tile_q", "offs_m"} <= dropped["fwd_row"]
    assert "seed" in dropped["fwd_ctx"] and "n_heads_q" in dropped["fwd_ctx"]
    assert "q" not in dropped["fwd_row"] and "qk_scale" not in dropped["fwd_ctx"]
    # A variant whose score reads the head keeps it; dropout keeps the seed.
    for spec, kept in (("attention a { input bias: f32[h]  score s + bias[h] }", "off_h"),
                       ("attention d { mask q >= k  dropout 0.1 }", "seed")):
        v = attncc.parse(spec)
        full = portable._environment().get_template("attention.py.jinja").render(
            **portable.template_context(v))
        assert kept not in parameters.unread(full)["fwd_ctx"]


def test_the_filter_keeps_order_and_drops_only_names_given():
    assert parameters.without("a, b, c , d", {"b", "d"}) == "a, c"
    assert parameters.without("a, b", frozenset()) == "a, b"
