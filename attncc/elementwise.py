"""IR expressions as Triton code over a tile: the mask, the score and its derivative.

Inside a tile, `q` is a [BLOCK_M, 1] column of global query positions and `k` a
[1, BLOCK_N] row of key positions, so an expression broadcasts to the tile's shape.
Tensor reads clamp their indices into range (the host proves them in range where it
can; see runtime.check_input_ranges), so a read can never fault.
"""
from __future__ import annotations

from . import ir
from .random_blocks import probability, threshold


def chance_threshold(e: ir.Call, params: dict) -> int:
    """The integer a chance(p, ...) hash is compared with (attncc/random_blocks.py)."""
    return threshold(probability(e, params))

VAR_CODE = {"q": "q_pos", "k": "k_pos", "b": "off_b", "h": "off_h", "s": "s",
            "dim": "HEAD_DIM", "len_q": "len_q", "len_k": "len_k"}


def input_arg_names(decl: ir.InputDecl) -> list:
    """The kernel arguments one input tensor needs: pointer, then stride and size per axis."""
    names = [f"{decl.name}_ptr"]
    for i in range(len(decl.axes)):
        names += [f"{decl.name}_stride{i}", f"{decl.name}_size{i}"]
    return names


class TritonEmitter:
    """Emits an expression as one Triton expression string."""

    def __init__(self, variant: ir.Variant, var_code: dict | None = None):
        self.params = {p.name: p.value for p in variant.params}
        self.inputs = {i.name: i for i in variant.inputs}
        self.var_code = dict(VAR_CODE, **(var_code or {}))

    def __call__(self, e) -> str:
        return getattr(self, type(e).__name__)(e)

    def Var(self, e):
        return self.var_code[e.name]

    def Const(self, e):
        if e.type == ir.BOOL:
            return "True" if e.value else "False"
        return repr(e.value)

    def Param(self, e):
        v = self.params[e.name]
        return ("True" if v else "False") if isinstance(v, bool) else repr(v)

    def Load(self, e):
        decl = self.inputs[e.tensor]
        offset = " + ".join(
            f"_clamp({self(i)}, {decl.name}_size{n}) * {decl.name}_stride{n}"
            for n, i in enumerate(e.indices))
        value = f"tl.load({decl.name}_ptr + {offset})"
        if decl.type == ir.FLOAT:
            return f"{value}.to(tl.float32)"
        if decl.type == ir.BOOL:
            return f"({value} != 0)"
        return f"{value}.to(tl.int32)"

    def BinOp(self, e):
        a, b = self(e.lhs), self(e.rhs)
        if e.op == "/":
            return f"(({a}) * 1.0 / ({b}))"
        if e.op == "//":
            return f"_fdiv({a}, {b})"
        if e.op == "%":
            return f"_mod({a}, {b})"
        return f"({a} {e.op} {b})"

    def Neg(self, e):
        return f"(-{self(e.operand)})"

    def Cmp(self, e):
        return f"({self(e.lhs)} {e.op} {self(e.rhs)})"

    def And(self, e):
        return f"({self(e.lhs)} & {self(e.rhs)})"

    def Or(self, e):
        return f"({self(e.lhs)} | {self(e.rhs)})"

    def Not(self, e):
        return f"({self(e.operand)} == 0)"

    def Call(self, e):
        if e.fn == "chance":
            # Keys may be compile-time ints (a seed param): adding a 0-d int32 tensor makes
            # each a tensor, which .to(tl.uint32) needs.
            keys = [f"(({self(a)}) + tl.zeros((), tl.int32))" for a in e.args[1:]]
            h = f"_chance_start({keys[0]})"
            for key in keys[1:]:
                h = f"_chance_step({h}, {key})"
            return f"_chance_keep({h}, {chance_threshold(e, self.params)})"
        args = [self(a) for a in e.args]
        if e.fn == "abs":
            return f"tl.abs({args[0]})"
        if e.fn == "min":
            return f"tl.minimum({args[0]}, {args[1]})"
        if e.fn == "max":
            return f"tl.maximum({args[0]}, {args[1]})"
        if e.fn == "tanh":
            return f"_tanh(({args[0]}) * 1.0)"
        return f"tl.{e.fn}(({args[0]}) * 1.0)"

    def Where(self, e):
        return f"tl.where({self(e.cond)}, {self(e.then)}, {self(e.other)})"
