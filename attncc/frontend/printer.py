"""IR -> the language: prints a Variant so that parsing the text gives the same Variant."""
from __future__ import annotations

from .. import ir

# Binding strength, loosest first; a child binding looser than its parent needs parentheses.
OR, AND, NOT, CMP, SUM, PRODUCT, UNARY, ATOM = range(1, 9)
LEVEL = {"+": SUM, "-": SUM, "*": PRODUCT, "/": PRODUCT, "//": PRODUCT, "%": PRODUCT}


def print_expr(e) -> str:
    return _fmt(e)[0]


def _wrap(child, min_level: int) -> str:
    text, level = _fmt(child)
    return f"({text})" if level < min_level else text


def _fmt(e):
    """(text, binding level) of an expression."""
    if isinstance(e, ir.Const):
        if e.type == ir.BOOL:
            return ("true" if e.value else "false"), ATOM
        text = repr(e.value) if e.type == ir.FLOAT else str(e.value)
        return text, (UNARY if text.startswith("-") else ATOM)
    if isinstance(e, (ir.Var, ir.Param)):
        return e.name, ATOM
    if isinstance(e, ir.Load):
        return f"{e.tensor}[{', '.join(print_expr(i) for i in e.indices)}]", ATOM
    if isinstance(e, ir.Member):
        row = ", ".join(print_expr(i) for i in e.indices)
        return f"{_wrap(e.item, SUM)} in {e.tensor}[{row}]", CMP
    if isinstance(e, ir.Call):
        return f"{e.fn}({', '.join(print_expr(a) for a in e.args)})", ATOM
    if isinstance(e, ir.Where):
        return f"where({print_expr(e.cond)}, {print_expr(e.then)}, {print_expr(e.other)})", ATOM
    if isinstance(e, ir.Neg):
        return f"-{_wrap(e.operand, UNARY)}", UNARY
    if isinstance(e, ir.BinOp):
        lvl = LEVEL[e.op]
        # Left-associative: the right operand needs parentheses at equal strength.
        return f"{_wrap(e.lhs, lvl)} {e.op} {_wrap(e.rhs, lvl + 1)}", lvl
    if isinstance(e, ir.Cmp):
        # Comparisons chain in the language, so a comparison operand is always wrapped.
        return f"{_wrap(e.lhs, SUM)} {e.op} {_wrap(e.rhs, SUM)}", CMP
    if isinstance(e, ir.Not):
        return f"not {_wrap(e.operand, NOT)}", NOT
    if isinstance(e, ir.And):
        return f"{_wrap(e.lhs, AND)} and {_wrap(e.rhs, AND + 1)}", AND
    if isinstance(e, ir.Or):
        return f"{_wrap(e.lhs, OR)} or {_wrap(e.rhs, OR + 1)}", OR
    raise TypeError(f"not an attncc expression: {e!r}")


def _fmt_value(value, type_: str) -> str:
    return print_expr(ir.Const(value, type_))


def print_variant(v: ir.Variant) -> str:
    lines = [f"attention {v.name} {{"]
    if v.heads:
        lines.append(f"    heads   {v.heads.q} / {v.heads.kv}")
    if v.scale is not None:
        lines.append(f"    scale   {print_expr(v.scale)}")
    for p in v.params:
        lines.append(f"    param   {p.name}: {p.type} = {_fmt_value(p.value, p.type)}")
    for i in v.inputs:
        axes = ", ".join(str(a) for a in i.axes)
        lines.append(f"    {'learnable ' if i.learnable else ''}input   {i.name}: {i.dtype}[{axes}]")
    if v.mask is not None:
        lines.append(f"    mask    {print_expr(v.mask)}")
    if v.layout is not None:
        lines.append(f"    layout  {print_expr(v.layout)}")
        lines.append(f"    block   {v.block}")
    if v.score is not None:
        lines.append(f"    score   {print_expr(v.score)}")
    if v.dropout is not None:
        lines.append(f"    dropout {v.dropout!r}")
    lines.append("}")
    return "\n".join(lines) + "\n"
