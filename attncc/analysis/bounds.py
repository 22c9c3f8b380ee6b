"""Analytic loop bounds: which keys a query tile can see, solved symbolically from the mask.

Skipping level 1 (docs/design.md, "Tiles and loop segments"). The mask is put in disjunctive normal form over its
comparisons; each comparison that is affine in (q, k) with constant coefficients
(causal, windows, prefix, offsets, bottom-right alignment) is solved with sympy for the
solved-for position, giving

  * the "reach": positions that some row of the tile may attend (the loop bounds), and
  * the "full" range: positions that every row of the tile attends, for every atom of
    the term (so the loop over them evaluates no mask).

Anything else (`%`, `//`, tensor reads, `!=`) is a residual atom: it does not narrow
the reach and makes the term's full range unknown, so those tiles are classified at
run time (attncc/analysis/intervals.py). The same code solves for q given a key tile, for the
backward's dK/dV loop.

Bounds are values of attncc/analysis/programs.py over affine sympy forms (`Affine`) of
run-time scalars named `{other}_lo`/`{other}_hi` (the tile's first and last global
position), `len_q`, `len_k`; a backend prints them (attncc/codegen/plan_code.py). The
comparisons are read into sympy by attncc/analysis/symbolic.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from .. import ir
from ..operators import NEGATED
from .programs import Lit, Op
from .symbolic import IntegerPolynomial, NotSymbolic

MAX_SEGMENTS = 2  # a union of more key intervals is looped over as its hull
# Comparisons with larger coefficients are left to the tile classification: with these,
# every bound the kernels compute from positions below 2**31 stays far inside 64 bits.
MAX_COEFFICIENT = 2 ** 20  # of q, k, len_q and len_k
MAX_CONSTANT = 2 ** 40

Q, K, LEN_Q, LEN_K = sympy.symbols("q k len_q len_k", integer=True)
_VARS = {"q": Q, "k": K, "len_q": LEN_Q, "len_k": LEN_K}


@dataclass(frozen=True)
class Atom:
    """One comparison `a*q + b*k + c <= 0` (a, b ints; c a sympy expr in len_q, len_k)."""
    a: int
    b: int
    c: sympy.Expr


@dataclass(frozen=True)
class Term:
    """A conjunction: affine atoms plus how many residual atoms it has."""
    atoms: tuple
    residual: int


@dataclass(frozen=True)
class Affine:
    """An affine sympy form of the positions, a leaf of a bound."""
    expr: sympy.Expr


@dataclass(frozen=True)
class Unbounded:
    """A leaf of a bound: the side has none (the guard of an empty range needs a value)."""


UNBOUNDED = Unbounded()


@dataclass(frozen=True)
class Segment:
    """Inclusive bounds (values of attncc/analysis/programs.py; None = unbounded) of one
    loop over solved positions."""
    reach_lo: str | None
    reach_hi: str | None
    full_lo: str | None  # None with full_known=False: no range is provably full
    full_hi: str | None
    full_known: bool


@dataclass(frozen=True)
class LoopPlan:
    """How the loop over the solved-for dimension is bounded for one variant."""
    segments: tuple  # of Segment; one unbounded segment when nothing is known
    needs_classify: bool  # some atom is residual: classify tiles at run time
    exact_full: bool  # full ranges are exact: FULL tiles need no check


# ------------------------------------------------------------------------ IR -> sympy
class _NotAffine(Exception):
    pass


class _Affine(IntegerPolynomial):
    """A side of a comparison as a polynomial in q, k, len_q, len_k with integer
    constants: + - * only, and no other index (b, h, dim are rare in masks that bound
    keys)."""

    def Var(self, e):
        if e.name in _VARS:
            return _VARS[e.name]
        raise NotSymbolic(e)


def _atoms_of_cmp(e: ir.Cmp, params: dict) -> list:
    """The affine atoms equivalent to comparison `e`; raises _NotAffine."""
    if e.op == "!=":
        raise _NotAffine
    side = _Affine(params)
    diff = sympy.expand(side(e.lhs) - side(e.rhs))
    poly = sympy.Poly(diff, Q, K)
    if poly.total_degree() > 1:
        raise _NotAffine
    a, b = int(poly.coeff_monomial(Q)) if poly.coeff_monomial(Q).is_Integer else None, \
        int(poly.coeff_monomial(K)) if poly.coeff_monomial(K).is_Integer else None
    if a is None or b is None:
        raise _NotAffine
    c = sympy.expand(diff - a * Q - b * K)
    if c.free_symbols - {LEN_Q, LEN_K}:
        raise _NotAffine
    c_poly = sympy.Poly(c, LEN_Q, LEN_K)
    if (max(abs(a), abs(b), abs(c_poly.coeff_monomial(LEN_Q)), abs(c_poly.coeff_monomial(LEN_K)))
            > MAX_COEFFICIENT or abs(c_poly.coeff_monomial(1)) > MAX_CONSTANT
            or c_poly.total_degree() > 1):
        raise _NotAffine
    # Integers: x < 0 is x + 1 <= 0, x > 0 is -x + 1 <= 0, x >= 0 is -x <= 0.
    if e.op == "<=":
        return [Atom(a, b, c)]
    if e.op == "<":
        return [Atom(a, b, c + 1)]
    if e.op == ">=":
        return [Atom(-a, -b, -c)]
    if e.op == ">":
        return [Atom(-a, -b, -c + 1)]
    if e.op == "==":
        return [Atom(a, b, c), Atom(-a, -b, -c)]
    raise _NotAffine


# ---------------------------------------------------------------------------- DNF
class _PushNot(ir.Visitor):
    """Negation pushed down to comparisons (De Morgan), so that DNF sees the atoms."""

    def Not(self, e):
        return _negation(e.operand)

    def And(self, e):
        return ir.And(self(e.lhs), self(e.rhs))

    def Or(self, e):
        return ir.Or(self(e.lhs), self(e.rhs))

    def other(self, e):
        return e


class _Negation(ir.Visitor):
    """`not e`, pushed down."""

    def Not(self, e):
        return _push_not(e.operand)

    def And(self, e):
        return ir.Or(self(e.lhs), self(e.rhs))

    def Or(self, e):
        return ir.And(self(e.lhs), self(e.rhs))

    def Cmp(self, e):
        return ir.Cmp(NEGATED[e.op], e.lhs, e.rhs)

    def Const(self, e):
        return ir.Const(not e.value, ir.BOOL)

    def other(self, e):
        return ir.Not(e)


_push_not, _negation = _PushNot(), _Negation()


MAX_TERMS = 16


class _Dnf(ir.Visitor):
    """A list of terms, each a list of leaf conditions; None when it grows too large."""

    def And(self, e):
        left, right = self(e.lhs), self(e.rhs)
        if left is None or right is None or len(left) * len(right) > MAX_TERMS:
            return None
        return [a + b for a in left for b in right]

    def Or(self, e):
        left, right = self(e.lhs), self(e.rhs)
        if left is None or right is None or len(left) + len(right) > MAX_TERMS:
            return None
        return left + right

    def other(self, e):
        return [[e]]


_dnf = _Dnf()


def terms_of(mask, params: dict):
    """The mask as Terms, or None when its structure is too large to analyse."""
    if mask is None:
        return [Term((), 0)]
    dnf = _dnf(_push_not(mask))
    if dnf is None:
        return None
    terms = []
    for leaves in dnf:
        atoms, residual, never = [], 0, False
        for leaf in leaves:
            if isinstance(leaf, ir.Const) and leaf.type == ir.BOOL:
                never |= not leaf.value
                continue
            try:
                if not isinstance(leaf, ir.Cmp):
                    raise _NotAffine
                atoms.extend(_atoms_of_cmp(leaf, params))
            except (_NotAffine, NotSymbolic, sympy.PolynomialError):
                residual += 1
        if not never:
            terms.append(Term(tuple(atoms), residual))
    return terms


# ----------------------------------------------------------------------- solving
def _floor_div(num: sympy.Expr, d: int):
    return Affine(num) if d == 1 else Op("fdiv", (Affine(num), Lit(d)))


def _ceil_div(num: sympy.Expr, d: int):
    return Affine(num) if d == 1 else Op("neg", (Op("fdiv", (Affine(-num), Lit(d))),))


def _solve_atom(atom: Atom, solve_for: str, forall: bool):
    """Bounds on `solve_for` from one atom, over the other position's tile range:
    (lo, hi), None for unbounded. Atoms free of `solve_for` are conditions instead
    (_side_condition)."""
    x_coef, y_coef = (atom.b, atom.a) if solve_for == "k" else (atom.a, atom.b)
    other = "q" if solve_for == "k" else "k"
    y_lo, y_hi = sympy.Symbol(f"{other}_lo", integer=True), sympy.Symbol(f"{other}_hi", integer=True)
    # x_coef*x + y_coef*y + c <= 0  with y in [y_lo, y_hi].
    if x_coef == 0:
        return None
    if x_coef > 0:
        # x <= (-y_coef*y - c) / x_coef: the reach takes the largest bound over y, the
        # full range the smallest.
        # The bound grows with y when y_coef < 0.
        want_large = not forall
        y = y_hi if (y_coef < 0) == want_large else y_lo
        if y_coef == 0:
            y = 0
        return None, _floor_div(sympy.expand(-y_coef * y - atom.c), x_coef)
    d = -x_coef
    # x >= (y_coef*y + c) / d: the reach takes the smallest bound over y, the full range the largest.
    # The bound grows with y when y_coef > 0.
    want_small = not forall
    y = y_lo if (y_coef > 0) == want_small else y_hi
    if y_coef == 0:
        y = 0
    return _ceil_div(sympy.expand(y_coef * y + atom.c), d), None


def _join(fn: str, items: list):
    """fn ("min" or "max") of the bounds given, None when none is."""
    items = [i for i in items if i is not None]
    if not items:
        return None
    out = items[0]
    for i in items[1:]:
        out = Op(fn, (out, i))
    return out


def _side_condition(atom: Atom, solve_for: str, forall: bool):
    """For an atom free of `solve_for`: true when some (all) rows satisfy it."""
    other = "q" if solve_for == "k" else "k"
    coef = atom.a if solve_for == "k" else atom.b
    y_lo, y_hi = sympy.Symbol(f"{other}_lo", integer=True), sympy.Symbol(f"{other}_hi", integer=True)
    if coef == 0:
        return Op("nonpositive", (Affine(atom.c),))
    # coef*y + c <= 0: smallest value at y_lo if coef > 0 else y_hi.
    y_best, y_worst = (y_lo, y_hi) if coef > 0 else (y_hi, y_lo)
    y = y_worst if forall else y_best
    return Op("nonpositive", (Affine(sympy.expand(coef * y + atom.c)),))


def _term_bounds(term: Term, solve_for: str, forall: bool):
    """(lo, hi, condition) for one term: the range, and a guard that empties it."""
    los, his, conds = [], [], []
    for atom in term.atoms:
        if (atom.b if solve_for == "k" else atom.a) == 0:
            conds.append(_side_condition(atom, solve_for, forall))
            continue
        lo, hi = _solve_atom(atom, solve_for, forall)
        los.append(lo)
        his.append(hi)
    cond = None
    for c in conds:
        cond = c if cond is None else Op("and", (cond, c))
    return _join("max", los), _join("min", his), cond


def _guarded(cond, hi):
    """hi where cond holds, else -1: no position."""
    return Op("where", (cond, UNBOUNDED if hi is None else hi, Lit(-1)))


def plan_loops(variant: ir.Variant, solve_for: str) -> LoopPlan:
    """The loop plan for the positions `solve_for` ('k' in the forward and dQ kernels,
    'q' in the dK/dV kernel) of one tile of the other dimension."""
    params = {p.name: p.value for p in variant.params}
    terms = terms_of(variant.mask, params)
    has_residual_inputs = variant.layout is not None
    if terms is None:
        return LoopPlan((Segment(None, None, None, None, False),), True, False)
    if not terms:  # the mask is never true
        return LoopPlan((), False, True)
    needs_classify = any(t.residual for t in terms) or has_residual_inputs
    segments = []
    for t in terms:
        lo, hi, cond = _term_bounds(t, solve_for, forall=False)
        flo, fhi, fcond = _term_bounds(t, solve_for, forall=True)
        if cond:
            # No row of the tile satisfies the term's side conditions: empty the range.
            hi = _guarded(cond, hi)
            lo = lo if lo is not None else Lit(0)
        full_known = t.residual == 0
        if fcond and full_known:
            fhi = _guarded(fcond, fhi)
            flo = flo if flo is not None else Lit(0)
        segments.append(Segment(lo, hi, flo if full_known else None,
                                fhi if full_known else None, full_known))
    if len(segments) > MAX_SEGMENTS:
        # Loop over the hull; tiles inside it are classified at run time.
        lo = None if any(s.reach_lo is None for s in segments) else _join("min", [s.reach_lo for s in segments])
        hi = None if any(s.reach_hi is None for s in segments) else _join("max", [s.reach_hi for s in segments])
        return LoopPlan((Segment(lo, hi, None, None, False),), True, False)
    exact_full = all(s.full_known for s in segments) and not has_residual_inputs
    return LoopPlan(tuple(segments), needs_classify, exact_full)
