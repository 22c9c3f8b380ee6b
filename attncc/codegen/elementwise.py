"""IR expressions as Triton code over a tile: the mask, the score and its derivative.

Inside a tile, `q` is a [BLOCK_M, 1] column of global query positions and `k` a
[1, BLOCK_N] row of key positions, so an expression broadcasts to the tile's shape.
Tensor reads clamp their indices into range, so a read can never fault.

Names a user chooses never meet the generated code's own: an input `x` is `in_x` in
generated code (`in_x_ptr`, `in_x_stride0`, `in_x_size0`, its gradient `d_in_x_ptr`),
and no generated name starts with `in_` or `d_in_`. Params are inlined as values.

Integers: an expression whose integer values may leave 32 bits (attncc/analysis/ranges.py) is
emitted with each integer leaf widened by `_int(x, FLAG)`: FLAG is the kernels'
constexpr WIDE (64 bits on calls past the expression's int32 extent) or True (always).
"""
from __future__ import annotations

from .. import ir
from ..semantics import operators
from ..semantics.random_blocks import probability, threshold


def chance_threshold(e: ir.Call, params: dict) -> int:
    """The integer a chance(p, ...) hash is compared with (attncc/semantics/random_blocks.py)."""
    return threshold(probability(e, params))

VAR_CODE = {"q": "q_pos", "k": "k_pos", "b": "off_b", "h": "off_h", "s": "s",
            "dim": "HEAD_DIM", "len_q": "len_q", "len_k": "len_k"}


def input_code(name: str) -> str:
    """An input's name in generated code (host and kernels)."""
    return f"in_{name}"


def input_arg_names(decl: ir.InputDecl) -> list:
    """The kernel arguments one input tensor needs: pointer, then stride and size per axis."""
    base = input_code(decl.name)
    names = [f"{base}_ptr"]
    for i in range(len(decl.axes)):
        names += [f"{base}_stride{i}", f"{base}_size{i}"]
    return names


def grad_arg_name(decl: ir.InputDecl) -> str:
    """The kernel argument of a learnable input's gradient."""
    return f"d_{input_code(decl.name)}_ptr"


def element_offset(emit, decl: ir.InputDecl, indices) -> str:
    """The offset of one element of an input: each index clamped into its axis, in 64
    bits on calls whose tensors are too large for 32-bit offsets (WIDE)."""
    base = input_code(decl.name)
    return " + ".join(f"_index({emit(i)}, {base}_size{n}, WIDE) * {base}_stride{n}"
                      for n, i in enumerate(indices))


def _int_literal(v: int) -> str:
    # Triton types a literal past 32 bits as int32 where it meets an int32 tensor (and
    # fails): give it its 64-bit type. Such an expression is emitted wide (ranges.py).
    if -2 ** 31 <= v < 2 ** 31:
        return repr(v)
    return f"tl.cast({v}, tl.int64)"


class TritonEmitter:
    """Emits an expression as one Triton expression string. `wide`: None (integers fit
    32 bits), "WIDE" (64 bits on wide calls) or "True" (always 64 bits)."""

    def __init__(self, variant: ir.Variant, var_code: dict | None = None, wide: str | None = None):
        self.params = {p.name: p.value for p in variant.params}
        self.inputs = {i.name: i for i in variant.inputs}
        self.var_code = dict(VAR_CODE, **(var_code or {}))
        self.wide = wide

    def __call__(self, e) -> str:
        return getattr(self, type(e).__name__)(e)

    def _int(self, code: str) -> str:
        return code if self.wide is None else f"_int({code}, {self.wide})"

    def Var(self, e):
        code = self.var_code[e.name]
        return code if e.name == "s" else self._int(code)

    def Const(self, e):
        if e.type == ir.BOOL:
            return "True" if e.value else "False"
        return _int_literal(e.value) if e.type == ir.INT else repr(e.value)

    def Param(self, e):
        v = self.params[e.name]
        if isinstance(v, bool):
            return "True" if v else "False"
        return _int_literal(v) if isinstance(v, int) else repr(v)

    def Load(self, e):
        decl = self.inputs[e.tensor]
        value = f"tl.load({input_code(decl.name)}_ptr + {element_offset(self, decl, e.indices)})"
        if decl.type == ir.FLOAT:
            return f"{value}.to(tl.float32)"
        if decl.type == ir.BOOL:
            return f"({value} != 0)"
        if decl.dtype == "i64":
            return value  # all 64 bits: ids 7 and 7 + 2**32 differ
        return self._int(f"{value}.to(tl.int32)")

    def BinOp(self, e):
        a, b = self(e.lhs), self(e.rhs)
        if e.op == "/":
            return f"(({a}) * 1.0 / ({b}))"
        if e.op in operators.HELPERS:  # Python's // and % (semantics/operators.py)
            return f"{operators.HELPERS[e.op][0]}({a}, {b})"
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
        if e.fn in ir.ROUNDING_FUNCTIONS:
            # float -> int rounds toward zero (int()); floor and ceil round first. Straight
            # to 64 bits where the expression may need them: an int32 cast would wrap.
            x = f"(({args[0]}) * 1.0)"
            rounded = x if e.fn == "int" else f"tl.{e.fn}({x})"
            return f"{rounded}.to({'tl.int32' if self.wide is None else 'tl.int64'})"
        return f"tl.{e.fn}(({args[0]}) * 1.0)"

    def Where(self, e):
        return f"tl.where({self(e.cond)}, {self(e.then)}, {self(e.other)})"
