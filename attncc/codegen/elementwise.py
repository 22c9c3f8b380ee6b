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

Operations are spelled as attncc/operators.py's `triton` column says; the emitter
reports the helpers and names each expression uses (attncc/codegen/printed.py).
"""
from __future__ import annotations

from .. import ir
from ..operators import entry_of
from .printed import Code, Printer

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


def _int_literal(v: int) -> str:
    # Triton types a literal past 32 bits as int32 where it meets an int32 tensor (and
    # fails): give it its 64-bit type. Such an expression is emitted wide (ranges.py).
    if -2 ** 31 <= v < 2 ** 31:
        return repr(v)
    return f"tl.cast({v}, tl.int64)"


# Index names that vary across a tile's pairs; a node reading none is one value per tile.
_PER_PAIR = {"q", "k", "qb", "kb", "s"}


class TritonEmitter(Printer):
    """Emits an expression as one Triton expression string. `wide`: None (integers fit
    32 bits), "WIDE" (64 bits on wide calls) or "True" (always 64 bits). `var_code`
    overrides index names' code: a name, or Code (an expression, with what it uses)."""

    cast = "({}) * 1.0"  # an operand an operation takes as a float
    # A comparison the same for the whole tile (a per-head gate `t[h] > 0.0`): Triton's
    # interpreter keeps a float scalar's comparison as float data, which `&` with the
    # tile's mask then refuses; the round trip makes it a bool there and compiles to
    # nothing on a GPU.
    tile_constant_bool = "({}).to(tl.int32).to(tl.int1)"

    def __init__(self, variant: ir.Variant, var_code: dict | None = None, wide: str | None = None):
        super().__init__()
        self.params = {p.name: p.value for p in variant.params}
        self.inputs = {i.name: i for i in variant.inputs}
        self.var_code = dict(VAR_CODE, **(var_code or {}))
        self.wide = wide

    @property
    def int_type(self) -> str:
        return "tl.int32" if self.wide is None else "tl.int64"

    def _int(self, code: str) -> str:
        if self.wide is None:
            return code
        self.use(("_int",), (self.wide,))
        return f"_int({code}, {self.wide})"

    def Var(self, e):
        code = self.var_code[e.name]
        if isinstance(code, Code):
            self.use(code.helpers, code.names)
            code = code.text
        else:
            self.use(names=(code,))
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

    def offset(self, decl: ir.InputDecl, indices) -> str:
        """The offset of one element of an input: each index clamped into its axis, in 64
        bits on calls whose tensors are too large for 32-bit offsets (WIDE)."""
        base = input_code(decl.name)
        self.use(("_index",), ["WIDE"] + [f"{base}_{kind}{n}" for n in range(len(indices))
                                          for kind in ("size", "stride")])
        return " + ".join(f"_index({self(i)}, {base}_size{n}, WIDE) * {base}_stride{n}"
                          for n, i in enumerate(indices))

    def Load(self, e):
        decl = self.inputs[e.tensor]
        return self.loaded(decl, self.offset(decl, e.indices))

    def loaded(self, decl: ir.InputDecl, offset: str) -> str:
        """The element of input `decl` at `offset` (code), read and converted as the
        language's values of its type are."""
        self.use(names=(f"{input_code(decl.name)}_ptr",))
        value = f"tl.load({input_code(decl.name)}_ptr + {offset})"
        if decl.type == ir.FLOAT:
            return f"{value}.to(tl.float32)"
        if decl.type == ir.BOOL:
            return f"({value} != 0)"
        if decl.dtype == "i64":
            return value  # all 64 bits: ids 7 and 7 + 2**32 differ
        return self._int(f"{value}.to(tl.int32)")

    def spelling(self, entry):
        return entry.triton

    def helpers_of(self, entry, e) -> tuple:
        return entry.helpers_of(e)

    def names_of(self, entry) -> tuple:
        """The kernel names the spelling reads besides its operands."""
        return ()

    def other(self, e):
        """An operation, as its spelling in attncc/operators.py writes it."""
        entry = entry_of(e)
        operands = [self(x) for x in ir.children(e)]
        if entry.float_operands:
            operands = [self.cast.format(x) for x in operands]
        self.use(self.helpers_of(entry, e), self.names_of(entry))
        spelling = self.spelling(entry)
        if callable(spelling):
            return spelling(self, e, operands)
        code = spelling.format(*operands, int=self.int_type)
        if self.tile_constant_bool and isinstance(e, ir.Cmp) and not ir.free_vars(e) & _PER_PAIR:
            code = self.tile_constant_bool.format(code)
        return code


class ScoreEmitter(TritonEmitter):
    """The emitter of a score and its derivatives: `tanh` calls `_tanh_fast(x,
    DOT_PRECISION)` (codegen/templates/expressions.py.jinja), whose 16-bit calls on an
    NVIDIA GPU take tanh.approx, one MUFU op, where _tanh takes some 25 instructions.
    Its relative error (PTX's bound 2^-11; 1.05e-5 measured on an H200) puts a softcap's
    score at most cap times that off, below the rounding a bf16 q and k already leave in
    q·k; fp32 calls (DOT_PRECISION "ieee") keep _tanh. benchmarks/softcap_accuracy.py
    measures both forms against float64."""

    FAST = {"tanh": "_tanh_fast"}

    def spelling(self, entry):
        fast = self.FAST.get(entry.name)
        return f"{fast}({{0}}, DOT_PRECISION)" if fast else entry.triton

    def helpers_of(self, entry, e) -> tuple:
        fast = self.FAST.get(entry.name)
        return (fast,) if fast else entry.helpers_of(e)

    def names_of(self, entry) -> tuple:
        return ("DOT_PRECISION",) if entry.name in self.FAST else ()


class WeightEmitter(ScoreEmitter):
    """The emitter of the pair weights of `normalize sum` and `none` and their
    derivatives: besides tanh, `sigmoid` calls `_sigmoid(x, DOT_PRECISION)`
    (codegen/templates/expressions.py.jinja), whose 16-bit calls on an NVIDIA GPU take
    one MUFU op per weight where tl.sigmoid takes two. The weights enter P.V in the
    inputs' dtype, whose rounding is coarser than the fast form's error; fp32 calls
    (DOT_PRECISION "ieee") keep tl.sigmoid. Under softmax a score's sigmoid would put an
    absolute error of 2^-12 times its factor into the exponent, near the weights' own
    rounding only where that factor is small: scores keep tl.sigmoid."""

    FAST = {"tanh": "_tanh_fast", "sigmoid": "_sigmoid"}


class ColumnReadsEmitter(TritonEmitter):
    """A mask as the Gluon kernels evaluate it on a score tile whose columns run along
    `column` ("k": key positions). A read indexed by that position alone (`doc_k[k]`,
    also by the batch and head) is loaded once per column, each thread of the warpgroup
    one element of `linear` (the columns' positions in a 1-D layout spread over the
    threads, generated code's name), then moved into the tile's column slice
    (`gl.convert_layout`, through shared memory) and broadcast over the rows. Loaded in
    the tile's own layout, each thread loads every column it holds: 32 loads a thread on
    a 64 x 128 warpgroup tile, with their address arithmetic, on every partial tile (the
    document mask's sm_90 SASS: 7040 instructions and 24 spill stores in the
    warp-specialized forward, 5592 and none loaded once per column)."""

    def __init__(self, variant: ir.Variant, column: str, linear: str, wide: str | None = None):
        super().__init__(variant, wide=wide)
        self.column, self.linear = column, linear

    def Load(self, e):
        reads = set().union(*(ir.free_vars(i) for i in e.indices))
        if self.column not in reads or not reads <= {self.column, "b", "h"}:
            return super().Load(e)
        tile_code = self.var_code[self.column]
        self.var_code[self.column] = self.linear
        try:
            value = super().Load(e)
        finally:
            self.var_code[self.column] = tile_code
        return f"gl.convert_layout({value}, col_layout)[None, :]"
