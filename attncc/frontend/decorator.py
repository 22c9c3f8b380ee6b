"""The Python front end: a variant written as decorated Python functions, traced to IR.

    @attncc.variant(heads=(32, 8), params={"window": 1024}, inputs={"slopes": "f32[h]"})
    class sliding_alibi:
        def mask(q, k, window):
            return (q >= k) & (q - k < window)
        def score(s, q, k, h, slopes):
            return s + slopes[h] * (k - q)

A class may also define `sink` (the language's `sink`: one extra logit per row, a
function of b, h, q and sizes), as in `def sink(h, sinks): return sinks[h]`.

Each function names what it reads by its parameters (index names, params, inputs) and
is called once with symbolic values, so it must be a single expression in disguise:
`&`, `|`, `~` stand for and, or, not (Python's own keywords cannot be traced), and
attncc.where/minimum/maximum/exp/... for the language's functions (FUNCTIONS: one for
each function of attncc/operators.py, under its `python` name). A function alone (not a
class) is the mask. The result is the same IR that the .attn text gives, so both compile
to byte-identical kernels.
"""
from __future__ import annotations

import inspect
import math
import re

from . import checker
from .. import ir
from ..errors import SpecError, did_you_mean
from .. import operators


class Sym:
    """A symbolic value while tracing: operators build IR instead of computing. Its
    operator methods are the table's (attncc/operators.py), set below the class."""
    __slots__ = ("node",)

    def __init__(self, node):
        self.node = node

    def __pos__(self):
        return self

    __hash__ = None

    def __bool__(self):
        raise SpecError("a traced value has no truth value while the variant is being built: "
                        "write `&`, `|`, `~` instead of and, or, not (with parentheses around "
                        "comparisons: (q >= k) & (k < 4)), attncc.where(c, a, b) instead of "
                        "`a if c else b`, attncc.minimum/maximum instead of min/max, and "
                        "`0 <= x` `x < w` as two comparisons instead of a chain")

    def __float__(self):
        raise SpecError(NOT_A_NUMBER)

    __int__ = __index__ = __float__

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise SpecError(_torch_hint(func))

    def __repr__(self):
        from ..ir import print_expr
        return f"Sym({print_expr(self.node)})"


def _method(entry, reflected: bool):
    """A special method of Sym building `entry`'s node; `reflected`: the traced value is
    the right operand (`1 - q`)."""
    if entry.arity == 1:
        return lambda self: Sym(entry.make(self.node))
    if reflected:
        return lambda self, other: Sym(entry.make(lift(other), self.node))
    return lambda self, other: Sym(entry.make(self.node, lift(other)))


def _install_methods():
    """Sym's operators, and what abs(), math.floor, math.ceil and math.trunc call (int()
    must return an int, so the language's int(x) is math.trunc(x) or attncc.trunc(x))."""
    for entry in (*operators.OPERATORS.values(), *operators.FUNCTIONS.values()):
        for i, name in enumerate(n for n in entry.python if n.startswith("__")):
            setattr(Sym, name, _method(entry, reflected=i == 1))


_install_methods()


def _traced(entry, name: str):
    """attncc.<name>: the language's function `entry` on traced values."""
    def function(*args):
        problem = entry.arity_problem(len(args))
        if problem:
            raise SpecError(problem)
        return Sym(entry.make(*(lift(a) for a in args)))
    function.__name__ = function.__qualname__ = name
    function.__doc__ = f"The language's {entry.name}{entry.signature} on traced values: {entry.doc}."
    return function


# attncc.where, attncc.minimum, attncc.exp, ...: every function of the language that
# Python has no syntax or builtin for (attncc/__init__.py exports them).
FUNCTIONS = {name: _traced(entry, name) for entry in operators.FUNCTIONS.values()
             for name in entry.python if not name.startswith("__")}
globals().update(FUNCTIONS)
_FUNCTION_LIST = ", ".join(f"attncc.{name}" for name in FUNCTIONS)
NOT_A_NUMBER = ("a traced value is not a number while the variant is being built: math.exp, "
                "math.log, float() and int() cannot take it; use attncc's functions "
                f"({_FUNCTION_LIST}), which build the expression (math.floor, math.ceil and "
                "math.trunc work too; the language's int(x) is attncc.trunc(x))")


def _attncc_for_torch() -> dict:
    """torch.<name> of a traced value -> what to write instead (torch.min and
    torch.minimum -> attncc.minimum(a, b); torch.abs -> abs(x))."""
    hints = {"isin": "attncc.isin(tile, row)"}
    for entry in operators.FUNCTIONS.values():
        named = [n for n in entry.python if not n.startswith("__")]
        spelling = f"attncc.{named[0]}{entry.signature}" if named else f"{entry.name}{entry.signature}"
        hints.update({name: spelling for name in (entry.name, *named)})
    return hints


_ATTNCC_FOR_TORCH = _attncc_for_torch()


def _torch_hint(func) -> str:
    """torch.where(...) on a traced value: which attncc function to write instead."""
    name = getattr(func, "__name__", str(func))
    instead = _ATTNCC_FOR_TORCH.get(name)
    fix = f"write {instead}" if instead else f"use attncc's functions ({_FUNCTION_LIST})"
    return (f"torch.{name} cannot take a traced value: a variant's functions build an "
            f"expression, not tensors; {fix}")


class TensorSym:
    """An `input` while tracing: indexing it gives a Load."""

    def __init__(self, name):
        self.name = name

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        return Sym(ir.Load(self.name, tuple(lift(i) for i in index)))

    def __bool__(self):
        raise SpecError(f"'{self.name}' is a tensor; index it, as in {self.name}[q]")

    __torch_function__ = Sym.__torch_function__


def lift(x):
    """A Python value or Sym as an IR node."""
    if isinstance(x, Sym):
        return x.node
    if isinstance(x, bool):
        return ir.Const(x, ir.BOOL)
    if isinstance(x, int):
        return ir.Const(x, ir.INT)
    if isinstance(x, float):
        if not math.isfinite(x):
            raise SpecError(f"the constant {x} is not finite; the language has no infinities")
        return ir.Const(x, ir.FLOAT)
    if isinstance(x, TensorSym):
        raise SpecError(f"'{x.name}' is a tensor; index it, as in {x.name}[q]")
    raise SpecError(f"cannot use a {type(x).__name__} ({x!r}) in a variant: only numbers, "
                    "booleans, index names, params and indexed inputs")


def isin(tile, row):
    """`tile in row`, the language's `kb in top[b, h, qb]`: attncc.isin(kb, top[b, h, qb])
    in a layout, with `top` an integer input whose last axis holds the list (Python's own
    `in` cannot be traced)."""
    row = lift(row)
    if not isinstance(row, ir.Load):
        raise SpecError("isin(tile, row): row must be an indexed input, as in top[b, h, qb]")
    return Sym(ir.Member(lift(tile), row.tensor, row.indices))


_INPUT_TYPE = re.compile(r"^\s*([a-z0-9]+)\s*\[\s*([^\]]*)\]\s*$")


def _parse_input_type(name: str, text: str, learnable: bool) -> ir.InputDecl:
    m = _INPUT_TYPE.match(text)
    if not m:
        raise SpecError(f"input '{name}': write its type as 'dtype[axes]', as in 'f32[h]', got {text!r}")
    axes = tuple(int(a) if a.strip().isdigit() else a.strip() for a in m.group(2).split(","))
    return ir.InputDecl(name, m.group(1), axes, learnable)


def _param_decl(name, value) -> ir.ParamDecl:
    if isinstance(value, bool):
        decl = ir.ParamDecl(name, ir.BOOL, value)
    elif isinstance(value, int):
        decl = ir.ParamDecl(name, ir.INT, value)
    elif isinstance(value, float):
        decl = ir.ParamDecl(name, ir.FLOAT, value)
    else:
        raise SpecError(f"param '{name}' must be an int, float or bool, got "
                        f"{type(value).__name__} {value!r}")
    checker.check_param_value(decl)
    return decl


def _check_arguments(name, heads, params, inputs, learnable, block, dropout):
    """The decorator's own arguments, each of the type it must have: a wrong one is named
    here, not met later as a Python error inside attncc."""
    if not isinstance(name, str):
        raise SpecError(f"name= is the variant's name, a string; got {name!r}")
    if heads is not None and not (isinstance(heads, (tuple, list)) and len(heads) == 2
                                  and all(_is_int(h) for h in heads)):
        raise SpecError(f"heads must be a pair of ints (query heads, key/value heads), as in "
                        f"heads=(32, 8); got {heads!r}")
    for what, value in (("params", params), ("inputs", inputs)):
        if value is not None and not isinstance(value, dict):
            example = "params={'window': 256}" if what == "params" else "inputs={'slopes': 'f32[h]'}"
            raise SpecError(f"{what} must be a dict of names, as in {example}; got "
                            f"{type(value).__name__}")
        for key in value or {}:
            if not isinstance(key, str):
                raise SpecError(f"{what}: names must be strings, got {key!r}")
    for key, text in (inputs or {}).items():
        if not isinstance(text, str):
            raise SpecError(f"input '{key}': its type must be a string 'dtype[axes]', as in "
                            f"'f32[h]'; got {type(text).__name__} {text!r}")
    if isinstance(learnable, str) or not isinstance(learnable, (list, tuple, set, frozenset)) \
            or not all(isinstance(n, str) for n in learnable):
        hint = f"; write learnable=[{learnable!r}]" if isinstance(learnable, str) else ""
        raise SpecError(f"learnable must be a list of input names, got {learnable!r}{hint}")
    if block is not None and not _is_int(block):
        raise SpecError(f"block must be an int (a power of two from 16 to 256), got {block!r}")
    if dropout is not None and (isinstance(dropout, bool) or not isinstance(dropout, (int, float))):
        raise SpecError(f"dropout must be a probability in [0, 1), got {dropout!r}")
    if dropout is not None and not math.isfinite(dropout):
        raise SpecError(f"dropout {dropout} is out of range: the probability must be in [0, 1)")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _trace(fn, decl: str, params: dict, inputs: dict):
    """Call `fn` with a symbolic value for each parameter it names."""
    args = []
    allowed = checker.ALLOWED_VARS[decl] | set(params) | set(inputs)
    for pname in inspect.signature(fn).parameters:
        if pname in params:
            args.append(Sym(ir.Param(pname)))
        elif pname in inputs:
            args.append(TensorSym(pname))
        elif pname in ir.INDEX_VARS:
            args.append(Sym(checker.Scope(decl, params, inputs).resolve(pname)))
        else:
            raise SpecError(f"{decl}(): parameter '{pname}' is not an index name, param or "
                            f"input{did_you_mean(pname, allowed)}")
    try:
        result = fn(*args)
    except SpecError:
        raise
    except Exception as err:  # numpy, a torch method, a typo: say what tracing needs
        raise SpecError(f"calling it with symbolic values raised {type(err).__name__}: {err}; a "
                        "variant's functions are called once to build an expression, from "
                        f"operators and attncc's functions ({_FUNCTION_LIST})") from None
    return lift(result)


def _where_is(fn) -> str:
    try:
        return f"{inspect.getsourcefile(fn)}:{inspect.getsourcelines(fn)[1]}"
    except (OSError, TypeError):
        return getattr(fn, "__qualname__", "<function>")


def build_variant(name: str, *, mask=None, score=None, layout=None, scale=None, heads=None,
                  params=None, inputs=None, learnable=(), block=None, dropout=None,
                  sink=None, normalize=ir.SOFTMAX, weight=None) -> ir.Variant:
    """The Variant for these Python pieces; the decorator's engine, usable directly."""
    _check_arguments(name, heads, params, inputs, learnable, block, dropout)
    params = dict(params or {})
    param_decls = tuple(_param_decl(n, v) for n, v in params.items())
    input_decls = tuple(_parse_input_type(n, t, n in learnable) for n, t in (inputs or {}).items())
    unknown = set(learnable) - {i.name for i in input_decls}
    if unknown:
        first = sorted(unknown)[0]
        declared = [i.name for i in input_decls]
        raise SpecError(f"learnable names {sorted(unknown)} are not inputs"
                        f"{did_you_mean(first, declared) if declared else '; declare them in inputs='}")
    pmap = {p.name: p for p in param_decls}
    imap = {i.name: i for i in input_decls}
    fields = {}
    checker.check_normalize(normalize)
    for decl, fn in (("scale", scale), ("mask", mask), ("layout", layout), ("score", score),
                     ("sink", sink), ("weight", weight)):
        if fn is None:
            continue
        if isinstance(fn, (int, float)) and not isinstance(fn, bool) and decl == "scale":
            fields[decl] = lift(float(fn))
            continue
        if not callable(fn):
            raise SpecError(f"{decl} must be a function of the names it reads"
                            + (" or a number" if decl == "scale" else "")
                            + f", got {type(fn).__name__} {fn!r}")
        try:
            fields[decl] = _trace(fn, decl, pmap, imap)
        except SpecError as err:
            raise SpecError(f"in {decl}() at {_where_is(fn)}: {err.message}") from None
    if heads is not None:
        heads = ir.Heads(*heads)
    v = ir.Variant(name=name, heads=heads, params=param_decls, inputs=input_decls, block=block,
                   dropout=None if dropout is None else float(dropout), normalize=normalize,
                   **fields)
    if name.startswith("<"):  # a lambda's __name__, or a callable's without one
        raise SpecError(f"{name!r} is not a name a variant can take (a lambda has none): pass "
                        "one with name=, as in attncc.variant(lambda q, k: q >= k, "
                        "name='causal')")
    try:
        return checker.check_variant(v)
    except SpecError as err:
        raise SpecError(f"variant '{name}': {err.message}{_precedence_hint(err.message)}") from None


def _precedence_hint(message: str) -> str:
    """The likely cause of `and`/`or` of a number in a decorated function: Python applies
    `&` and `|` (which build them) before comparisons."""
    for word, symbol in (("and", "&"), ("or", "|")):
        if message.startswith(f"`{word}` needs conditions"):
            return (f" (here `{word}` is `{symbol}`, which Python applies before comparisons: "
                    f"`q >= k {symbol} (q - k < 5)` is `q >= (k {symbol} (q - k < 5))`; "
                    f"parenthesize each comparison, `(q >= k) {symbol} (q - k < 5)`)")
    return ""


def variant(_obj=None, *, name=None, heads=None, params=None, inputs=None, learnable=(),
            block=None, dropout=None, scale=None, normalize=ir.SOFTMAX):
    """Decorate a function (the mask) or a class holding mask/score/layout/scale/sink functions
    (and `weight`, with normalize="sum" or "none").

    Returns an ir.Variant, which attncc.compile() and attncc.reference() accept.
    """
    def wrap(obj):
        if inspect.isclass(obj):
            parts = {d: obj.__dict__.get(d)
                     for d in ("mask", "score", "layout", "scale", "sink", "weight")}
            parts = {d: (f.__func__ if isinstance(f, staticmethod) else f) for d, f in parts.items()}
            unknown = [a for a in vars(obj) if not a.startswith("_") and a not in parts]
            if unknown:
                raise SpecError(f"variant class '{obj.__name__}' has {unknown}; it may define "
                                "only mask, score, layout, scale, sink and weight"
                                f"{did_you_mean(unknown[0], parts)}")
        elif callable(obj):
            parts = {"mask": obj}
        else:
            raise SpecError(f"@attncc.variant decorates a function (the mask) or a class of "
                            f"mask/score/layout/scale/sink functions, not a {type(obj).__name__}")
        own_name = getattr(obj, "__name__", None)  # a functools.partial has none
        if scale is not None:
            if parts.get("scale") is not None:
                raise SpecError(f"variant '{own_name}' declares its scale twice: in "
                                f"scale={scale!r} and in its scale() function; keep one")
            parts["scale"] = scale
        if name is None:
            name_of = own_name if own_name is not None else f"<{type(obj).__name__}>"
        else:
            name_of = name
        return build_variant(name_of, heads=heads, params=params, inputs=inputs,
                             learnable=learnable, block=block, dropout=dropout,
                             normalize=normalize, **parts)

    return wrap(_obj) if _obj is not None else wrap
