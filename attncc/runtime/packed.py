"""Packed variable-length sequences: a variant rewritten to run within each sequence.

`attncc.varlen(spec)` takes q, k, v packed as (total, heads, dim) with flash-attn's
`cu_seqlens_q`/`cu_seqlens_k` (int32 sequence starts, then the total) and runs them as
one batch of one long sequence, viewed as (1, heads, total, dim) without a copy. No
kernel changes: the variant is rewritten (`varlen_variant`; see `_Rewrite`) so that

  * `q`, `k` count from their sequence's start, `len_q`, `len_k` are that sequence's
    lengths and `b` its index, all read from per-position int32 inputs derived from
    cu_seqlens (`varlen_...[q]`, `varlen_...[k]`);
  * the mask gains `varlen_seq_q[q] == varlen_seq_k[k]` (the sequence of each position).

The interval analysis then classifies tiles from per-block min/max summaries of these
inputs (attncc/analysis/intervals.py): a tile joining two different sequences is empty, a tile
inside one sequence is classified exactly as in a dense call, and only tiles on a
sequence boundary evaluate the mask per element. Nothing is padded, and no probability
across sequences is other than 0; but a boundary tile's products still multiply those
zeros by the other sequence's keys and values, so a NaN or inf there reaches this one
(README, Packed sequences).

Inputs the variant declares keep their meaning per sequence: an input on a `q` or `k`
axis is packed like q or k (total_q or total_k entries), and its index expression is
evaluated in in-sequence positions, reading the current sequence's entries (`doc[q]`
reads query q's own entry). An input on the batch axis `b` has one entry per sequence
and must be read as `x[b, ...]`; it is gathered per packed query position on the host.
"""
from __future__ import annotations

import dataclasses
import numbers
from collections import OrderedDict

import numpy
import torch

from .. import ir
from ..arguments import refuse_seed_without_dropout
from ..errors import CallError
from .eager import run_eagerly

PREFIX = "varlen_"
# Per-position int32 inputs the rewrite may read, in declaration order: (name, axis).
DERIVED = (("seq_q", "q"), ("seq_k", "k"), ("pos_q", "q"), ("pos_k", "k"),
           ("len_q", "q"), ("len_k", "k"), ("start_q", "q"), ("start_k", "k"))
# Per-sequence quantities a linear term combines, in the order names list them.
SEQUENCE_VALUES = ("start_q", "start_k", "len_q", "len_k")
POSITIONS = ("q", "k", "len_q", "len_k")
FLIPPED = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "==", "!=": "!="}


def _read(name: str, side: str) -> ir.Load:
    """`varlen_<name>[q]` or `varlen_<name>[k]`: a per-position value at the pair's q or k."""
    return ir.Load(PREFIX + name, (ir.Var(side),))


@dataclasses.dataclass(frozen=True)
class Term:
    """A per-position int32 input: a combination of the position's sequence's start and
    length on each side, `sum(coef * value)`, read at each q (side "q") or k position."""
    name: str
    side: str
    coefs: tuple  # ((value in SEQUENCE_VALUES, int), ...), nonzero, in that order


def _term(side: str, coefs: dict) -> Term:
    words = []
    for value in SEQUENCE_VALUES:
        c = coefs.get(value, 0)
        if c:
            size = f"{abs(c)}_" if abs(c) != 1 else ""
            sign = ("minus_" if c < 0 else "plus_") if words or c < 0 else ""
            words.append(f"{sign}{size}{value}")
    return Term(f"{PREFIX}{side}_{'_'.join(words)}",
                side, tuple((v, coefs[v]) for v in SEQUENCE_VALUES if coefs.get(v)))


class _LinearForm(ir.Visitor):
    """`e` as an integer linear form {symbol: coefficient} (1 keys the constant; q, k,
    len_q, len_k are positions; h, dim and int params pass through as IR nodes), or None
    when it is not one."""

    def Const(self, e):
        return {1: e.value} if e.type == ir.INT else None

    def Param(self, e):
        return None  # its value is not known here; kept as it is by the caller

    def Var(self, e):
        if e.name in POSITIONS:
            return {e.name: 1}
        return {e: 1} if e.name in ("h", "dim") else None

    def Neg(self, e):
        x = self(e.operand)
        return None if x is None else {key: -c for key, c in x.items()}

    def BinOp(self, e):
        if e.op not in ("+", "-", "*"):
            return None
        a, b = self(e.lhs), self(e.rhs)
        if a is None or b is None:
            return None
        if e.op == "*":
            if set(a) <= {1}:
                a, b = b, a
            if not set(b) <= {1}:
                return None
            c = b.get(1, 0)
            return {key: c * x for key, x in a.items() if c * x}
        sign = 1 if e.op == "+" else -1
        out = dict(a)
        for key, c in b.items():
            out[key] = out.get(key, 0) + sign * c
        return {key: c for key, c in out.items() if c}

    def other(self, e):
        return None


_linear = _LinearForm()


class _Rewrite(ir.Visitor):
    """Rewrites one variant's expressions into in-sequence form, noting what it reads.

    Within sequence s, query q and key k sit at positions q - start_q(s) and
    k - start_k(s). An integer expression linear in q, k, len_q, len_k becomes
    `a*q + b*k + t[side]` with t one per-position input combining the sequence's starts
    and lengths (a `Term`): the packed positions q and k stay exact, so a tile inside one
    sequence is bounded exactly, and where the packings of q and k agree (self-attention)
    t is the same on both sides of every sequence boundary, so `q - k + t[q] >= 0`
    (causal) is exact on tiles that straddle a boundary too. A comparison of two linear
    sides is rewritten as one linear form against a constant, for the same reason.
    Anything else reads the positions themselves (`varlen_pos_q[q]`, ...)."""

    def __init__(self, variant: ir.Variant):
        self.inputs = {d.name: d for d in variant.inputs}
        self.used: set = set()
        self.terms: dict = {}  # name -> Term

    def read(self, name: str) -> ir.Load:
        side = dict(DERIVED)[name]
        self.used.add(name)
        return _read(name, side)

    def linear(self, form: dict, extra: dict | None = None, with_constant: bool = True):
        """The packed expression of an in-sequence linear form (plus `extra`, more
        per-sequence values to add, as a load's start)."""
        a, b = form.get("q", 0), form.get("k", 0)
        coefs = {"start_q": -a, "start_k": -b, "len_q": form.get("len_q", 0),
                 "len_k": form.get("len_k", 0)}
        for value, c in (extra or {}).items():
            coefs[value] += c
        coefs = {v: c for v, c in coefs.items() if c}
        parts = [(c, ir.Var(key)) for key, c in (("q", a), ("k", b)) if c]
        parts += [(c, key) for key, c in form.items() if isinstance(key, ir.Var)]
        if coefs:
            side = "k" if a == 0 and b != 0 else "q"
            term = _term(side, coefs)
            self.terms[term.name] = term
            parts.append((1, ir.Load(term.name, (ir.Var(side),))))
        if with_constant and form.get(1):
            parts.append((form[1], ir.Const(form[1], ir.INT)))
        expr = None
        for c, node in parts:
            if isinstance(node, ir.Const):
                node, c = ir.Const(abs(c), ir.INT), (1 if c > 0 else -1)
            elif abs(c) != 1:
                node = ir.BinOp("*", ir.Const(abs(c), ir.INT), node)
            if expr is None:
                expr = node if c > 0 else ir.Neg(node)
            else:
                expr = ir.BinOp("+" if c > 0 else "-", expr, node)
        return expr if expr is not None else ir.Const(0, ir.INT)

    def __call__(self, e):
        # A linear integer form in the positions becomes a Term whatever its node (a
        # comparison of two such forms is one linear form too: Cmp below).
        form = _linear(e)
        if form is not None and any(key in POSITIONS for key in form):
            return self.linear(form)
        return super().__call__(e)

    def Cmp(self, e):
        lhs, rhs = _linear(e.lhs), _linear(e.rhs)
        if lhs is not None and rhs is not None:
            form = dict(lhs)
            for key, c in rhs.items():
                form[key] = form.get(key, 0) - c
            form = {key: c for key, c in form.items() if c}
            if any(key in POSITIONS for key in form):
                op = e.op
                if form.get("q", 0) < 0 or (not form.get("q") and form.get("k", 0) < 0):
                    # q first and positive (`k <= q` reads `q - k >= 0`), so that the
                    # same difference is the same Term.
                    form = {key: -c for key, c in form.items()}
                    op = FLIPPED[op]
                return ir.Cmp(op, self.linear(form, with_constant=False),
                              ir.Const(-form.get(1, 0), ir.INT))
        return self.other(e)

    def Var(self, e):
        mapped = {"q": "pos_q", "k": "pos_k", "len_q": "len_q", "len_k": "len_k",
                  "b": "seq_q"}.get(e.name)
        return self.read(mapped) if mapped else e

    def Load(self, e):
        return self.load(e)

    def Member(self, e):  # only in layouts, which varlen refuses
        raise CallError("index lists (`kb in t[...]`) have no meaning in a packed stream")

    def Const(self, e):
        return e

    Param = Const

    def other(self, e):
        """Any other node, rebuilt from its rewritten parts."""
        fields = {f.name: getattr(e, f.name) for f in dataclasses.fields(e)}
        for name, value in fields.items():
            if isinstance(value, tuple):
                fields[name] = tuple(self(x) for x in value)
            elif not isinstance(value, str):
                fields[name] = self(value)
        return type(e)(**fields)

    def load(self, e: ir.Load) -> ir.Load:
        decl = self.inputs[e.tensor]
        indices = []
        for axis, index in zip(decl.axes, e.indices):
            if axis in ("q", "k"):
                if index == ir.Var(axis):
                    indices.append(index)  # the position's own entry: its packed index
                    continue
                # An in-sequence index into this sequence's stretch of the packed axis.
                form = _linear(index)
                if form is not None:
                    indices.append(self.linear(form, extra={f"start_{axis}": 1}))
                else:
                    # The start read at the query (the mask keeps q and k in one sequence):
                    # a sink has no k to read varlen_start_k at.
                    start = self.linear({}, extra={f"start_{axis}": 1})
                    indices.append(ir.BinOp("+", self(index), start))
            elif axis == "b":
                if index != ir.Var("b"):
                    raise CallError(
                        f"input '{e.tensor}' is read at batch index `{_text(index)}`; in a "
                        f"packed call an input on the batch axis holds one entry per sequence "
                        f"and must be read as {e.tensor}[b, ...]")
                indices.append(ir.Var("q"))  # gathered per packed query position
            else:
                indices.append(self(index))
        return ir.Load(e.tensor, tuple(indices))


def _text(e) -> str:
    from ..ir import print_expr
    return print_expr(e)


def _rewrite_variant(variant: ir.Variant):
    """(the packed variant, its linear Terms by name)."""
    if variant.layout is not None:
        raise CallError(
            f"variant '{variant.name}' has a layout (block {variant.block}): its blocks tile "
            "one sequence from position 0, but in a packed batch the blocks of the stream do "
            "not start where sequences start, so varlen cannot run it; pad the sequences to "
            "a batch and call the kernel, or express the pattern as a mask")
    taken = {d.name for d in variant.inputs} | {p.name for p in variant.params}
    clash = sorted(n for n in taken if n.startswith(PREFIX))
    if clash:
        raise CallError(f"variant '{variant.name}' declares {clash[0]!r}; names starting with "
                        f"'{PREFIX}' are the inputs varlen adds: rename it")
    for decl in variant.inputs:
        if "b" in decl.axes[1:]:
            raise CallError(
                f"input '{decl.name}' has axes [{', '.join(map(str, decl.axes))}]: varlen "
                "gathers a batch-axis input per packed position along its first axis; "
                f"declare the batch axis first ({decl.name}: [b, ...])")
        if "b" in decl.axes and any(a in ("q", "k", "qb", "kb") for a in decl.axes):
            raise CallError(
                f"input '{decl.name}' has axes [{', '.join(map(str, decl.axes))}]: varlen "
                "gathers batch-axis inputs per packed position, which it can do only when "
                "no other axis is a position axis")
    rewrite = _Rewrite(variant)
    same_sequence = ir.Cmp("==", rewrite.read("seq_q"), rewrite.read("seq_k"))
    mask = same_sequence if variant.mask is None else ir.And(same_sequence, rewrite(variant.mask))
    score = None if variant.score is None else rewrite(variant.score)
    sink = None if variant.sink is None else rewrite(variant.sink)
    weight = None if variant.weight is None else rewrite(variant.weight)
    inputs = tuple(dataclasses.replace(d, axes=tuple("q" if a == "b" else a for a in d.axes))
                   for d in variant.inputs)
    inputs += tuple(ir.InputDecl(PREFIX + name, "i32", (axis,))
                    for name, axis in DERIVED if name in rewrite.used)
    terms = dict(sorted(rewrite.terms.items()))
    inputs += tuple(ir.InputDecl(t.name, "i32", (t.side,)) for t in terms.values())
    packed = dataclasses.replace(variant, name=f"{variant.name}_varlen", inputs=inputs,
                                 mask=mask, score=score, sink=sink, weight=weight)
    return packed, terms


def varlen_variant(variant: ir.Variant) -> ir.Variant:
    """The variant that runs `variant` within each sequence of a packed batch of one."""
    return _rewrite_variant(variant)[0]


# ----------------------------------------------------------------- per-position inputs
def read_cu_seqlens(name: str, cu, device) -> bytes:
    """One cu_seqlens tensor's values (int32 bytes: a cheap key, compared with memcmp),
    after checking what needs no values: one host read, a synchronisation where it lives
    on a GPU."""
    if not isinstance(cu, torch.Tensor):
        raise CallError(f"{name} must be a torch.Tensor of int32 sequence starts, "
                        f"got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise CallError(f"{name} has dtype {cu.dtype}; it must be torch.int32, as in "
                        f"flash-attn (convert it with .to(torch.int32))")
    if cu.dim() != 1 or cu.numel() < 1:
        raise CallError(f"{name} must be 1-D with one entry per sequence plus one "
                        f"(batch + 1,), got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise CallError(f"{name} is on {cu.device} but q is on {device}; move it with "
                        ".to(q.device)")
    if cu.is_cuda and torch.cuda.is_current_stream_capturing():
        raise CallError(
            f"{name} is read on the host to check it and to pick its packing, which a CUDA "
            "graph cannot capture (a replay would run the packing of the captured call "
            "whatever the buffer then holds); build the packing before capturing, "
            "packing = attncc.varlen_packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, "
            "max_seqlen_k), and pass packing=packing: every replay runs that packing")
    return cu.cpu().numpy().tobytes()


def _values(data: bytes) -> list:
    return numpy.frombuffer(data, dtype=numpy.int32).tolist()


def check_max_seqlen(max_seqlen, max_name: str, longest: tuple):
    """max_seqlen against the packing's longest sequence, (index, length)."""
    if (not isinstance(max_seqlen, numbers.Integral) or isinstance(max_seqlen, bool)
            or max_seqlen < 0):
        raise CallError(f"{max_name} must be a non-negative int, got {max_seqlen!r}")
    i, length = longest
    if length > max_seqlen:
        raise CallError(f"{max_name}={max_seqlen} is smaller than the longest sequence "
                        f"(sequence {i} has {length} tokens); pass at least {length}")


def check_values(name: str, values: list, total: int, total_name: str) -> tuple:
    """Check one cu_seqlens's values; its longest sequence, (index, length)."""
    if values[0] != 0:
        raise CallError(f"{name} must start at 0, got {values[0]}")
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            raise CallError(f"{name} must be non-decreasing (cumulative sequence lengths), but "
                            f"entry {i} ({values[i]}) is less than entry {i - 1} ({values[i - 1]})")
    if values[-1] != total:
        raise CallError(f"{name} ends at {values[-1]}, but {total_name} has {total} tokens; "
                        f"its last entry must be the total")
    lengths = [b - a for a, b in zip(values, values[1:])]
    longest = max(lengths, default=0)
    return (lengths.index(longest) if lengths else 0), longest


def _positions(cu: torch.Tensor, total: int) -> dict:
    """Per packed position: its sequence, position in it, sequence length and start (int32)."""
    at = torch.arange(total, device=cu.device, dtype=torch.int32)
    # The sequence holding position i is the number of sequence ends at or before i.
    seq = torch.searchsorted(cu[1:], at, right=True).to(torch.int32)
    start = cu[seq.long()]
    length = cu[seq.long() + 1] - start
    return {"seq": seq, "pos": at - start, "len": length.to(torch.int32),
            "start": start.to(torch.int32)}


class Packing:
    """The checked packing of one pair of cu_seqlens values: per-position int32 tensors
    for both sides, built from those values (not from the caller's tensors, which may be
    written afterwards), and the longest sequence of each side."""

    def __init__(self, values_q: list, values_k: list, device, longest: dict):
        self.values = (tuple(values_q), tuple(values_k))
        self.totals = (values_q[-1], values_k[-1])
        self.longest = longest  # "q" / "k" -> (index, length): max_seqlen is checked per call
        self.n_sequences = len(values_q) - 1
        # Normal tensors even in an inference_mode call: a later training call with the
        # same values saves them for backward, and the tables' cache reads their versions.
        with torch.inference_mode(False):
            self._build(values_q, values_k, device)

    def _build(self, values_q: list, values_k: list, device):
        cu_q, cu_k = (torch.tensor(v, dtype=torch.int32, device=device)
                      for v in (values_q, values_k))
        q_side, k_side = _positions(cu_q, values_q[-1]), _positions(cu_k, values_k[-1])
        self.tensors = {}
        for name, axis in DERIVED:
            side = q_side if axis == "q" else k_side
            self.tensors[name] = side[name.rsplit("_", 1)[0]].contiguous()
        self.seq_q_long = q_side["seq"].long()
        self._seq = {"q": self.seq_q_long, "k": k_side["seq"].long()}
        self._per_sequence = {"start_q": cu_q[:-1].long(), "start_k": cu_k[:-1].long(),
                              "len_q": (cu_q[1:] - cu_q[:-1]).long(),
                              "len_k": (cu_k[1:] - cu_k[:-1]).long()}

    def term(self, term: Term) -> torch.Tensor:
        """A Term's values at each position of its side (computed once per packing)."""
        if term.name not in self.tensors:
            with torch.inference_mode(False):
                total = sum(c * self._per_sequence[value] for value, c in term.coefs)
                low, high = (int(x) for x in torch.aminmax(total)) if total.numel() else (0, 0)
                if low < -2 ** 31 or high >= 2 ** 31:
                    spelt = " + ".join(f"{c}·{value}" for value, c in term.coefs)
                    raise CallError(
                        f"a per-sequence offset of the packed variant ({spelt}, from a linear "
                        f"form of its positions) reaches {high if high >= 2 ** 31 else low} "
                        "at this packing, past the int32 the kernels index with; use smaller "
                        "coefficients in the spec (divide out a common factor) or pack fewer "
                        "tokens per call")
                self.tensors[term.name] = (total[self._seq[term.side]].to(torch.int32)
                                           .contiguous())
        return self.tensors[term.name]

    def check_call(self, total_q: int, total_k: int, max_q, max_k):
        """A call's token counts and max_seqlen against this packing (no values read)."""
        for side, total, name in (("q", total_q, "cu_seqlens_q"), ("k", total_k, "cu_seqlens_k")):
            expected = self.totals[0 if side == "q" else 1]
            if total != expected:
                raise CallError(f"{name} ends at {expected}, but {side} has {total} tokens; "
                                f"its last entry must be the total")
        check_max_seqlen(max_q, "max_seqlen_q", self.longest["q"])
        check_max_seqlen(max_k, "max_seqlen_k", self.longest["k"])


def _checked_packing(values_q: list, values_k: list, total_q: int, total_k: int,
                     device) -> Packing:
    longest_q = check_values("cu_seqlens_q", values_q, total_q, "q")
    longest_k = check_values("cu_seqlens_k", values_k, total_k, "k")
    if len(values_q) != len(values_k):
        raise CallError(f"cu_seqlens_q has {len(values_q)} entries and cu_seqlens_k "
                        f"{len(values_k)}; both must hold one entry per sequence plus one")
    return Packing(values_q, values_k, device, {"q": longest_q, "k": longest_k})


class _PackingCache:
    """Checked packings, keyed by the values of cu_seqlens_q and cu_seqlens_k: every
    call reads them (one host read of 2 x (batch + 1) int32 each: a synchronisation on
    a GPU), so a call runs the packing its tensors hold at the call, however they were
    written (in place through .numpy() or .data, by a kernel, a new tensor at a freed
    tensor's address), never an older one. The layers of a model share one packing
    per step: its per-position tensors are built once and the kernels' tile tables,
    keyed by those tensors, are reused across layers and across steps with the same
    lengths. Calls that must not synchronise (CUDA graph capture) pass a kept packing
    (attncc.varlen_packing) instead."""

    SIZE = 16

    def __init__(self):
        self.entries: OrderedDict = OrderedDict()

    # Host reads of tensor values: under torch.compile a graph break, run eagerly here.
    @run_eagerly
    def get(self, cu_q, cu_k, total_q, total_k, max_q, max_k, device) -> Packing:
        key = (read_cu_seqlens("cu_seqlens_q", cu_q, device),
               read_cu_seqlens("cu_seqlens_k", cu_k, device), str(device))
        packing = self.entries.get(key)
        if packing is None:
            packing = _checked_packing(_values(key[0]), _values(key[1]), total_q, total_k,
                                       device)
            self.entries[key] = packing
            if len(self.entries) > self.SIZE:
                self.entries.popitem(last=False)
        else:
            self.entries.move_to_end(key)
        packing.check_call(total_q, total_k, max_q, max_k)
        return packing


_PACKINGS = _PackingCache()


def _state(t: torch.Tensor) -> tuple:
    # An inference tensor has no version counter (and is written in place only inside
    # inference_mode): its address, shape and strides stand for it.
    version = None if t.is_inference() else t._version
    return (t.data_ptr(), version, tuple(t.shape), t.stride(), t.dtype, str(t.device))


class KeptPacking:
    """A packing checked once, for calls that read no cu_seqlens values: `packing=` of
    a varlen kernel or of flash_attn_varlen_func. Built by `attncc.varlen_packing(...)`
    (one host read). Calls given it must pass the same cu_seqlens tensors, unwritten
    since as far as PyTorch sees (their version counters), and are refused otherwise;
    keeping it is the caller's promise that no write PyTorch cannot see (.numpy(),
    .data, a kernel, a CUDA graph replay refilling the buffer) changes their values while
    it is used: such calls run the kept packing, whatever the tensors then hold."""

    def __init__(self, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if not isinstance(cu, torch.Tensor):
                raise CallError(f"{name} must be a torch.Tensor of int32 sequence starts, "
                                f"got {type(cu).__name__}")
        device = cu_seqlens_q.device
        values_q = _values(read_cu_seqlens("cu_seqlens_q", cu_seqlens_q, device))
        values_k = _values(read_cu_seqlens("cu_seqlens_k", cu_seqlens_k, device))
        self.packing = _checked_packing(values_q, values_k, values_q[-1], values_k[-1], device)
        self.packing.check_call(values_q[-1], values_k[-1], max_seqlen_q, max_seqlen_k)
        self.device = device
        self._tensors = (cu_seqlens_q, cu_seqlens_k)  # held: their addresses stay theirs
        self._states = (_state(cu_seqlens_q), _state(cu_seqlens_k))

    @run_eagerly  # reads data pointers and version counters: real tensors
    def get(self, cu_q, cu_k, total_q, total_k, max_q, max_k, device) -> Packing:
        """The kept packing for a call, after checks that read no values."""
        if device != self.device:
            raise CallError(f"this packing was built on {self.device}, but q is on {device}; "
                            "build one from cu_seqlens on q's device")
        for name, cu, kept, state in zip(("cu_seqlens_q", "cu_seqlens_k"), (cu_q, cu_k),
                                         self._tensors, self._states):
            if not isinstance(cu, torch.Tensor) or _state(cu) != state:
                what = ("it was written in place since" if cu is kept
                        else f"this call passes another {name}")
                raise CallError(f"packing= was built from {name} as it was then, but {what}; "
                                "build a new packing with attncc.varlen_packing(...) when "
                                "the sequences change")
        self.packing.check_call(total_q, total_k, max_q, max_k)
        return self.packing

    def __repr__(self):
        lengths = [b - a for a, b in zip(self.packing.values[0], self.packing.values[0][1:])]
        return (f"<attncc kept packing: {self.packing.n_sequences} sequences, "
                f"{self.packing.totals[0]}/{self.packing.totals[1]} tokens, longest "
                f"{max(lengths, default=0)} queries>")


def varlen_packing(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> KeptPacking:
    """A packing to keep and pass as `packing=` to varlen kernels and
    flash_attn_varlen_func: checked and built now (one host read), so that the calls
    given it read no values (no synchronisation; CUDA graphs can capture them). See
    KeptPacking for what keeping it promises."""
    return KeptPacking(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


def _check_packed(name: str, t, dims: str):
    if not isinstance(t, torch.Tensor):
        raise CallError(f"{name} must be a torch.Tensor of shape {dims}, got {type(t).__name__}")
    if t.dim() != 3:
        raise CallError(f"{name} must have 3 dimensions {dims}, packed as in flash-attn's "
                        f"varlen functions, got shape {tuple(t.shape)}")


class VarlenKernel:
    """A compiled variant over packed sequences:
    `vk(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **inputs)`."""

    def __init__(self, kernel):
        from .kernel import Kernel
        self.base = kernel.variant
        self.variant, self.terms = _rewrite_variant(kernel.variant)
        config = kernel.pinned_config
        self.kernel = Kernel(self.variant, config.as_dict() if hasattr(config, "as_dict") else config,
                             kernel.requested_backend)

    def __repr__(self):
        return f"<attncc varlen kernel '{self.base.name}': {self.kernel.strategy}>"

    def _bind(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, inputs,
              packing=None):
        """(q, k, v as (1, heads, total, dim) views, the derived variant's inputs)."""
        _check_packed("q", q, "(total_q, heads, dim)")
        _check_packed("k", k, "(total_k, heads_k, dim)")
        _check_packed("v", v, "(total_k, heads_k, dim)")
        if packing is not None and not isinstance(packing, KeptPacking):
            raise CallError(f"packing must come from attncc.varlen_packing(...), got "
                            f"{type(packing).__name__}")
        packing = (packing or _PACKINGS).get(cu_seqlens_q, cu_seqlens_k, q.shape[0],
                                             k.shape[0], max_seqlen_q, max_seqlen_k, q.device)
        bound = {}
        for decl in self.base.inputs:
            t = inputs.get(decl.name)
            if decl.axes and decl.axes[0] == "b" and isinstance(t, torch.Tensor):
                if t.shape[0] != packing.n_sequences:
                    raise CallError(f"input '{decl.name}' has {t.shape[0]} entries on its batch "
                                    f"axis, but cu_seqlens_q describes {packing.n_sequences} "
                                    "sequences; a packed call takes one entry per sequence")
                t = t.index_select(0, packing.seq_q_long)
            if t is not None:
                bound[decl.name] = t
        for name in sorted(set(inputs) - set(bound)):
            if name in _DENSE_ONLY:
                raise CallError(f"a varlen call takes no {name}=: {_DENSE_ONLY[name]}")
            if name.startswith(PREFIX):
                raise CallError(f"'{name}' is computed from cu_seqlens_q and cu_seqlens_k; "
                                "do not pass it")
            bound[name] = inputs[name]  # the kernel's checks name it as unexpected
        for decl in self.variant.inputs:
            if decl.name in self.terms:
                bound[decl.name] = packing.term(self.terms[decl.name])
            elif decl.name.startswith(PREFIX):
                bound[decl.name] = packing.tensors[decl.name[len(PREFIX):]]
        view = lambda t: t.unsqueeze(0).transpose(1, 2)  # (1, heads, total, dim), no copy
        return view(q), view(k), view(v), bound

    def __call__(self, /, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                 return_lse: bool = False, dropout_seed: int | None = None,
                 training: bool = True, packing: KeptPacking | None = None, **inputs):
        """Attention within each packed sequence: out (total_q, heads, dim) and, with
        return_lse, the LSE (heads, total_q), as flash-attn's varlen functions return.
        The cu_seqlens values are read on every call (one host read), unless `packing`
        (attncc.varlen_packing(...)) was built from them."""
        refuse_seed_without_dropout(self.base, dropout_seed)  # named as the caller's variant
        q4, k4, v4, bound = self._bind(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                       max_seqlen_k, inputs, packing)
        result = self.kernel(q4, k4, v4, return_lse=return_lse, dropout_seed=dropout_seed,
                             training=training, layout="bhsd", **bound)
        if return_lse:
            out, lse = result
            return out[0].transpose(0, 1), lse[0]
        return result[0].transpose(0, 1)

    def reference(self, /, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                  return_lse: bool = False, dropout_seed: int | None = None,
                  training: bool = True, packing: KeptPacking | None = None, **inputs):
        """The dense reference of the same packed call (attncc.reference of the derived
        variant: any dtype, float64 for truth, the same dropout bits as the kernel)."""
        from ..semantics.reference import reference
        refuse_seed_without_dropout(self.base, dropout_seed)
        q4, k4, v4, bound = self._bind(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                       max_seqlen_k, inputs, packing)
        result = reference(self.variant, q4, k4, v4, return_lse=return_lse,
                           dropout_seed=dropout_seed, training=training, layout="bhsd",
                           **bound)
        if return_lse:
            out, lse = result
            return out[0].transpose(0, 1), lse[0]
        return result[0].transpose(0, 1)

    def density(self, /, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                block: int = 64, **inputs) -> float:
        """The fraction of block x block tiles of the packed (total_q x total_k) matrix that
        the kernels visit (see Kernel.density)."""
        q4, k4, v4, bound = self._bind(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                       max_seqlen_k, inputs)
        return self.kernel.density(q4, k4, v4, block=block, **bound)


# Keywords of a dense call that a packed one has no use for, and why (they were passed
# on to the kernel as inputs: a bare TypeError, or a message about varlen's own inputs).
_DENSE_ONLY = {
    "layout": "q, k and v are (total, heads, dim), as flash-attn's varlen functions take them",
    "q_offset": "positions count from each sequence's start, as cu_seqlens place them",
    "k_offset": "positions count from each sequence's start, as cu_seqlens place them",
    "tables": "the packed call builds its tile tables from cu_seqlens (keep them with "
              "packing=attncc.varlen_packing(...))",
}


def varlen(spec, *, config: dict | None = None, backend: str = "auto") -> VarlenKernel:
    """A kernel over packed variable-length sequences, from a compiled kernel (its pinned
    config and backend carry over), a Variant, a path or spec text. Only the rewritten
    variant is compiled. `config` and `backend` as attncc.compile takes them."""
    from ..frontend.load import load
    from .kernel import Kernel
    if isinstance(spec, Kernel):
        if config is not None or backend != "auto":
            raise CallError("varlen(kernel) takes the kernel's own config and backend; pass "
                            "config= and backend= to attncc.compile, or give varlen the spec")
        return VarlenKernel(spec)
    return VarlenKernel(_Uncompiled(load(spec), config, backend))


@dataclasses.dataclass
class _Uncompiled:
    """What VarlenKernel reads of a kernel, for a variant that need not be compiled itself."""
    variant: ir.Variant
    pinned_config: dict | None
    requested_backend: str = "auto"
