"""Context parallelism: one sequence's attention split over the ranks of a process group.

Each rank holds a shard of the sequence: one or two *pieces* of equal length, in the
order `Sharding` gives them. Keys and values visit the other ranks; every (query piece,
key piece) pair that may hold an allowed (q, k) pair is one call of the compiled
kernel at the two pieces' absolute offsets (the kernels take absolute positions), and
the partial outputs merge exactly through their log-sum-exps. Each pair's forward is the
one a single-device call of that pair would run (`Kernel.forward_role`: on Hopper the
Gluon forward where it takes the call); the pieces' backward is portable (the Gluon dK/dV
and dQ kernels run single-device backwards only, so far). The backward sends the
keys and values again; each rank adds dQ for its own queries, and sends the dK/dV it
computed for a visiting piece back to that piece's owner.

    sharding = Sharding.of(group, "zigzag")
    q, k, v = (sharding.shard(t) for t in (q, k, v))          # this rank's pieces
    out = context_parallel_attention(kernel, q, k, v, group=group, doc_q=doc, doc_k=doc)

Sharding. "contiguous" gives rank r the r-th of W equal pieces. "zigzag" cuts the
sequence into 2W pieces and gives rank r pieces r and 2W-1-r, so that under a causal
mask every rank has the same work (ring-flash-attention's scheme).

Inputs the variant reads on position axes (q, k, qb, kb: document ids, per-position
tensors) are passed whole, for the global sequence, the same on every rank: they are
O(S), and every piece pair reads them at its own absolute positions. Build them from
shards with `Sharding.unshard_inputs`. Inputs on other axes are passed as usual.

Skipping. Which piece pairs may attend is decided with the kernels' own tile
classification (the generated `tile_tables`, with tiles one piece long): a pair is
skipped only when no (q, k) pair in it can attend (conservative, like the kernels'
tiles). Hop t brings rank r the keys of rank r - t, sent by their owner directly (a
shift, not a ring that forwards them), so each hop's transfer is skipped on its own
when the receiver has no pair to compute with them: a sliding window exchanges keys
with its neighbours only. For masks and layouts that read no tensor, the schedule is
computed on the host from shapes alone (no communication, cached); when they read
tensors (document ids), each rank classifies on its device, from inputs the agreement
below found the same on every rank, so every rank makes the same schedule.

Overlap. The next hop's keys and values are posted (`batch_isend_irecv`) before the
current hop is computed, and a hop's dK/dV are posted as soon as they are computed. On
CUDA, the NCCL backend runs point-to-point work on its own stream, which waits for the
current stream where the work is posted, and `wait()` makes the current stream wait for
it, so the transfers overlap the kernels without a stream of our own; with gloo on the
CPU they run on gloo's threads.

Agreement. Every rank must call with shards of one length, the same scheme, kernel,
batch, heads, dtype, inputs and (with dropout) dropout_seed, and all record a backward
or none. Before any transfer, one all-gather of a few int64 per rank (`Signature`: those
fields and a checksum of each input) checks it, and also carries whether the rank's own
checks refused the call: a refusal or a disagreement raises the same CallError on
every rank (`agree`), so no rank waits on a transfer that never comes, and none
computes with buffers sized from another rank's length. Uneven shards are refused, not
supported: the pieces have one length, which sizes every transfer and piece pair.
"""
from __future__ import annotations

import dataclasses
import weakref
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import ir
from .runtime import sinks, tuning
from .runtime.call_options import CallOptions
from .arguments import Problem, check_return_lse, check_seed
from .errors import CallError

SCHEMES = ("zigzag", "contiguous")
POSITION_AXES = ("q", "k")
BLOCK_AXES = ("qb", "kb")
_SCHEDULES: dict = {}  # schedules of masks that read no tensor, by shape
_SCHEDULES_SIZE = 64


# ------------------------------------------------------------------------ sharding
@dataclass(frozen=True)
class Sharding:
    """Which pieces of the sequence each rank of a group holds, and in what order."""
    scheme: str
    world_size: int
    rank: int

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise CallError(f"scheme={self.scheme!r} is not a sharding scheme; use one of "
                            f"{', '.join(map(repr, SCHEMES))}")
        if not (0 <= self.rank < self.world_size):
            raise CallError(f"rank {self.rank} is not in a group of {self.world_size}; a rank "
                            "must call with a group it belongs to")

    @classmethod
    def of(cls, group=None, scheme: str = "zigzag") -> "Sharding":
        """This rank's sharding in `group` (default: the whole world)."""
        if not dist.is_available() or not dist.is_initialized():
            raise CallError("torch.distributed is not initialised: call "
                            "torch.distributed.init_process_group first (backend 'nccl' on "
                            "GPUs, 'gloo' on the CPU)")
        return cls(scheme, dist.get_world_size(group), dist.get_rank(group))

    @property
    def n_pieces(self) -> int:
        """Pieces in the whole sequence."""
        return 2 * self.world_size if self.scheme == "zigzag" else self.world_size

    def pieces_of(self, rank: int) -> tuple:
        """The piece indices rank `rank` holds, in the order of its local tensors."""
        if self.scheme == "zigzag":
            return (rank, 2 * self.world_size - 1 - rank)
        return (rank,)

    @property
    def pieces(self) -> tuple:
        return self.pieces_of(self.rank)

    def piece_len(self, seq_len: int) -> int:
        """The length of each piece of a sequence of `seq_len` positions."""
        n = self.n_pieces
        if seq_len == 0:
            raise CallError(f"the sequence is empty (0 positions): {self.scheme} sharding over "
                            f"{self.world_size} ranks cuts it into {n} non-empty pieces of equal "
                            f"length; pass a sequence of at least {n} positions (a multiple of "
                            f"{n})")
        if seq_len < n or seq_len % n:
            per_rank = f"two pieces per rank, {n} in all" if self.scheme == "zigzag" else f"{n} pieces"
            raise CallError(f"a sequence of {seq_len} positions cannot be cut into {per_rank} "
                            f"of equal length ({self.scheme} sharding over {self.world_size} "
                            f"ranks); use a length that is a multiple of {n} (pad it)")
        return seq_len // n

    def positions(self, seq_len: int, device=None) -> torch.Tensor:
        """The absolute positions of this rank's tokens, in local order (e.g. for RoPE)."""
        c = self.piece_len(seq_len)
        return torch.cat([torch.arange(p * c, (p + 1) * c, device=device) for p in self.pieces])

    def shard(self, x: torch.Tensor, dim: int = 2, unit: int = 1) -> torch.Tensor:
        """This rank's pieces of a whole-sequence tensor, along `dim` (q, k, v, dO, labels).
        `unit`: positions per entry along dim (a layout's block, for qb/kb axes)."""
        c = self.piece_len(x.shape[dim] * unit)
        if c % unit:
            raise CallError(f"pieces of {c} positions do not hold whole blocks of {unit}; use a "
                            f"sequence length that is a multiple of {self.n_pieces * unit}")
        c //= unit
        return torch.cat([x.narrow(dim, p * c, c) for p in self.pieces], dim)

    def join(self, shards, dim: int = 2) -> torch.Tensor:
        """The whole-sequence tensor from every rank's shard (a list in rank order)."""
        if len(shards) != self.world_size:
            raise CallError(f"join takes one shard per rank ({self.world_size}), got {len(shards)}")
        n_local = len(self.pieces)
        c = shards[0].shape[dim] // n_local
        by_piece = {}
        for rank, shard in enumerate(shards):
            for i, piece in enumerate(self.pieces_of(rank)):
                by_piece[piece] = shard.narrow(dim, i * c, c)
        return torch.cat([by_piece[p] for p in range(self.n_pieces)], dim)

    def unshard(self, x: torch.Tensor, dim: int = 2, group=None) -> torch.Tensor:
        """The whole-sequence tensor from this rank's shard: an all-gather over `group`
        (every rank gets it). Not differentiable: for evaluation, inputs and tests."""
        gathered = [torch.empty_like(x, memory_format=torch.contiguous_format)
                    for _ in range(self.world_size)]
        dist.all_gather(gathered, x.contiguous(), group=group)
        return self.join(gathered, dim)

    def shard_inputs(self, variant: ir.Variant, inputs: dict) -> dict:
        """This rank's pieces of the variant's inputs along their position axes (q, k,
        and qb, kb by layout blocks); other axes and inputs are left whole."""
        return {name: self._each_position_axis(variant, name, t, self.shard)
                for name, t in inputs.items()}

    def unshard_inputs(self, variant: ir.Variant, inputs: dict, group=None) -> dict:
        """Whole-sequence inputs from shards along their position axes: what
        context_parallel_attention takes (all-gathers, one per sharded axis)."""
        gather = lambda t, dim, unit: self.unshard(t, dim, group)
        return {name: self._each_position_axis(variant, name, t, gather)
                for name, t in inputs.items()}

    def _each_position_axis(self, variant, name, t, fn):
        decl = {d.name: d for d in variant.inputs}.get(name)
        if decl is None:
            return t
        for dim, axis in enumerate(decl.axes):
            if axis in POSITION_AXES:
                t = fn(t, dim, 1)
            elif axis in BLOCK_AXES:
                t = fn(t, dim, variant.block)
        return t


# ------------------------------------------------------------------------ schedule
@dataclass(frozen=True)
class Schedule:
    """Which piece pairs each rank computes, and which hops send keys: the same on
    every rank. At hop t rank r holds the keys and values of rank (r - t) mod W."""
    sharding: Sharding
    seq_len: int
    piece_len: int
    may_attend: tuple  # [query piece][key piece]: some (q, k) of the pair may attend
    # [query piece][key piece]: every (q, k) of the pair attends (this rank's view: only
    # where configs are tuned, so ranks need not agree on it).
    wholly_attended: tuple

    @property
    def world_size(self) -> int:
        return self.sharding.world_size

    def source(self, hop: int, rank: int | None = None) -> int:
        """Whose keys rank `rank` (default: this rank) holds at `hop`."""
        rank = self.sharding.rank if rank is None else rank
        return (rank - hop) % self.world_size

    def pairs(self, hop: int, rank: int | None = None) -> list:
        """(query piece, key piece) to compute at `hop`, as indices into the local query
        pieces and into the visiting shard's pieces."""
        rank = self.sharding.rank if rank is None else rank
        mine, theirs = self.sharding.pieces_of(rank), self.sharding.pieces_of(self.source(hop, rank))
        return [(i, j) for i, qp in enumerate(mine) for j, kp in enumerate(theirs)
                if self.may_attend[qp][kp]]

    def receives(self, hop: int, rank: int | None = None) -> bool:
        """Whether `rank` receives keys at `hop` (it has a pair to compute with them)."""
        return hop > 0 and bool(self.pairs(hop, rank))

    def sends(self, hop: int, rank: int | None = None) -> bool:
        """Whether `rank` sends its keys at `hop` (to rank + hop, which needs them)."""
        rank = self.sharding.rank if rank is None else rank
        return hop > 0 and self.receives(hop, (rank + hop) % self.world_size)

    def communicates(self, hop: int) -> bool:
        """Whether any rank sends anything at `hop`."""
        return any(self.receives(hop, r) for r in range(self.world_size))

    def __str__(self) -> str:
        lines = [f"{self.sharding.scheme} sharding of {self.seq_len} positions over "
                 f"{self.world_size} ranks, pieces of {self.piece_len}:"]
        for hop in range(self.world_size):
            work = ", ".join(f"rank {r} <- {self.source(hop, r)}: {len(self.pairs(hop, r))} pairs"
                             for r in range(self.world_size))
            tag = "" if hop == 0 or self.communicates(hop) else " (no communication)"
            lines.append(f"  hop {hop}{tag}: {work}")
        return "\n".join(lines)


def piece_classification(kernel, sharding: Sharding, problem: Problem, inputs: dict,
                         device, kinds=("full", "part")) -> torch.Tensor:
    """bool [pieces, pieces]: whether some (q, k) of a (query piece, key piece) pair may
    attend, from the kernels' tile classification with tiles one piece long (tensor
    work of O(pieces^2 + S), no S x S mask). Conservative: never False where a pair
    attends (tests/test_distributed.py checks it against the dense mask). With
    kinds=("full",): whether every (q, k) of the pair attends."""
    return _classify(kernel, sharding, problem, inputs, device, kinds)[0]


def _classify(kernel, sharding, problem, inputs, device, *kind_sets) -> list:
    """For each set of tile kinds, bool [pieces, pieces]: the pairs classified as one of
    them, from one build of the tile tables."""
    c, n = sharding.piece_len(problem.len_q), sharding.n_pieces
    t = kernel.module.tile_tables(problem.batch, problem.heads_q, problem.len_q, problem.len_k,
                                  0, 0, problem.dim, inputs, c, c, device)
    ids = torch.arange(n, device=device)
    kept = {}
    for kind in ("full", "part"):
        lists = t[f"row_{kind}_list"].long()  # [B|1, H|1, n, n]: the kept tiles first
        listed = ids < t[f"row_{kind}_count"].unsqueeze(-1)  # [B|1, H|1, n, n]
        kept[kind] = torch.zeros(lists.shape, dtype=torch.bool, device=device).scatter_(
            -1, lists, listed).flatten(0, 1)
    # A pair is wholly attended only where it is full for every batch row and head.
    return [torch.stack([kept[k] for k in kinds]).any(0).any(0) if "part" in kinds
            else torch.stack([kept[k] for k in kinds]).any(0).all(0) for kinds in kind_sets]


def make_schedule(kernel, sharding: Sharding, problem: Problem, inputs: dict,
                  device) -> Schedule:
    """The schedule of a call whose whole sequence is `problem`. Masks and layouts that
    read no tensor are classified on the host from shapes alone (and cached); those
    that read tensors, on the device, from the inputs `agree` found the same on every
    rank, so every rank makes the same schedule without communicating."""
    reads = kernel.module.TABLE_INPUTS
    key = (kernel.key, sharding, problem)
    if not reads and key in _SCHEDULES:
        return _SCHEDULES[key]
    may, whole = _classify(kernel, sharding, problem, inputs,
                           device if reads else torch.device("cpu"), ("full", "part"), ("full",))
    schedule = Schedule(sharding, problem.len_q, problem.len_q // sharding.n_pieces,
                        tuple(tuple(row) for row in may.tolist()),
                        tuple(tuple(row) for row in (whole & may).tolist()))
    if not reads:
        if len(_SCHEDULES) >= _SCHEDULES_SIZE:
            _SCHEDULES.pop(next(iter(_SCHEDULES)))
        _SCHEDULES[key] = schedule
    return schedule


# ------------------------------------------------------------------------ the call
def context_parallel_attention(kernel, q, k, v, /, *, group=None, scheme: str = "zigzag",
                               return_lse: bool = False, dropout_seed: int | None = None,
                               training: bool = True, **inputs):
    """Attention of `kernel` over a sequence sharded across `group` (default: the world).

    q, k, v: this rank's shard, (batch, heads, local length, dim), its pieces in the
    order `Sharding(scheme, ...)` gives (`Sharding.shard` cuts them from a whole
    tensor); every rank's shard has the same length. Returns this rank's shard of the
    output (and of the LSE with return_lse=True); differentiable in q, k, v and
    learnable inputs, through the output and the merged LSE alike. The result equals
    the kernel on the whole sequence. Inputs on position axes are passed whole; every
    input is the same on every rank; the gradient of a learnable input is this rank's
    share (sum it over the group, as for any replicated parameter). With dropout,
    `dropout_seed` is required, the same on every rank. One small all-gather checks all
    of this before any transfer (`agree`): a call refused on one rank is refused on
    every rank.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise CallError("torch.distributed is not initialised: call "
                        "torch.distributed.init_process_group first (backend 'nccl' on "
                        "GPUs, 'gloo' on the CPU)")
    try:
        prepared, refusal = _prepare(kernel, q, k, v, group, scheme, dropout_seed, training,
                                     inputs), None
        check_return_lse(prepared[0].variant, return_lse)
    except CallError as e:
        prepared, refusal = None, e
    if dist.get_rank(group) < 0:  # no rank of the group waits for this process
        raise CallError("this process is not a member of the group it passes; call with a "
                        "group it belongs to")
    agree(Signature.of(kernel, q, k, v, scheme, dropout_seed, training, inputs,
                       refused=refusal is not None), refusal, group,
          device=q.device if isinstance(q, torch.Tensor) else None)
    kernel, sharding, problem = prepared
    sink_variant = kernel.variant if kernel.variant.sink is not None else None
    if sink_variant is not None:
        kernel = _without_sink(kernel)
    schedule = make_schedule(kernel, sharding, problem, inputs, q.device)
    variant = kernel.variant
    names = [d.name for d in variant.inputs]
    values = [inputs[n].contiguous() if variant.input(n).learnable else inputs[n] for n in names]
    call = _RingAttention(kernel, schedule, group, CallOptions(seed=int(dropout_seed or 0)),
                          names, problem, sink_variant)
    out, lse = _ContextParallelAttention.apply(call, q, k, v, *values)
    return (out, lse) if return_lse else out


def _prepare(kernel, q, k, v, group, scheme, dropout_seed, training, inputs) -> tuple:
    """(kernel, sharding, whole-sequence Problem) of a call, checked on this rank alone;
    raises CallError naming what is wrong (which `agree` then raises on every rank)."""
    from .runtime.kernel import Kernel
    if not isinstance(kernel, Kernel):
        raise CallError(f"kernel must come from attncc.compile(...), got {type(kernel).__name__}")
    if not isinstance(training, bool):
        raise CallError(f"training must be True or False, got {training!r}")
    if not training and kernel.variant.dropout:
        kernel = kernel.evaluation_kernel()
    if "tables" in inputs:
        raise CallError("tables= is not taken by context_parallel_attention: it keeps the tile "
                        "tables of each piece pair itself")
    sharding = Sharding.of(group, scheme)
    variant = kernel.variant
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        kernel.check_call(q, k, v, inputs, 0, 0, "bhsd")  # raises the kernel's own message
    if q.shape[2] != k.shape[2]:
        raise CallError(f"q has {q.shape[2]} positions on this rank but k has {k.shape[2]}; "
                        "context parallelism shards one sequence, so q, k and v have the same "
                        "local length")
    if q.shape[2] == 0:
        raise CallError(f"this rank's shard is empty (q, k and v have 0 positions): every rank "
                        f"holds {len(sharding.pieces)} non-empty piece(s) of one length "
                        f"({scheme} sharding over {sharding.world_size} ranks); cut a sequence "
                        f"of at least {sharding.n_pieces} positions with Sharding.shard")
    seq_len = q.shape[2] * sharding.world_size
    c = sharding.piece_len(seq_len)
    if variant.block is not None and c % variant.block:
        raise CallError(f"pieces of {c} positions do not hold whole layout blocks of "
                        f"{variant.block}; use a sequence length that is a multiple of "
                        f"{sharding.n_pieces * variant.block}")
    lengths = {"len_q", "len_k"} & set().union(
        *(ir.free_vars(e) for e in (variant.mask, variant.score, variant.layout, variant.sink,
                                    variant.weight)
          if e is not None))
    if lengths:
        raise CallError(f"variant '{variant.name}' reads {' and '.join(sorted(lengths))}, which "
                        "in each piece's call would be the piece's length, not the sequence's; "
                        "write the sequence length as a param to run it context-parallel")
    if variant.dropout:
        if not isinstance(dropout_seed, int) or isinstance(dropout_seed, bool):
            raise CallError(f"variant '{variant.name}' has dropout: pass dropout_seed=int, the "
                            "same on every rank, so that every rank drops the bits the whole "
                            f"sequence's call would (got {dropout_seed!r})")
        check_seed(dropout_seed)
    # Check the call as the whole sequence: zero-copy views of the global shape carry
    # the dtype, device and head counts; inputs must be whole.
    whole = [t[:, :, :1].expand(t.shape[0], t.shape[1], seq_len, t.shape[3]) for t in (q, k, v)]
    try:
        problem = kernel.check_call(*whole, inputs, 0, 0, "bhsd")
    except CallError as e:
        raise CallError(f"{e} (context_parallel_attention checks the call as the whole sequence "
                        f"of {seq_len} positions: inputs on position axes are passed whole, the "
                        "same on every rank)") from None
    return kernel, sharding, problem


# ------------------------------------------------------------------------ agreement
# What every rank of a call must agree on, gathered in one all-gather of int64 before
# any transfer: a rank that computes with other lengths, another scheme, seed or
# inputs sizes its buffers and pairs differently (garbage, NaN or a hang), and a rank
# that refuses a call must not leave the others waiting in a transfer.
SIGNATURE_FIELDS = ("refused", "scheme", "kernel", "training", "dropout_seed", "len_q",
                    "len_k", "len_v", "shapes", "records_backward")
INPUT_SLOTS = 8  # inputs beyond the eighth share its slots: still checked, named together
CHECKSUM_WORDS = 3  # per input: its shape and dtype, and two sums of its bits
_SIGNATURE_LEN = len(SIGNATURE_FIELDS) + INPUT_SLOTS * CHECKSUM_WORDS


@dataclass
class Signature:
    """This rank's view of a call: the fields every rank must share, as int64 (host
    ints, and the inputs' checksums on their device until the all-gather)."""
    fields: list          # ints, in SIGNATURE_FIELDS order
    input_names: list     # the names of the input slots, in order
    checksums: list       # one int64 [CHECKSUM_WORDS] tensor per input slot

    @classmethod
    def of(cls, kernel, q, k, v, scheme, dropout_seed, training, inputs, *, refused: bool):
        """Computed from whatever the rank passed, valid or not (a refused call still
        takes part in the all-gather)."""
        from .runtime.kernel import Kernel
        is_kernel = isinstance(kernel, Kernel)
        tensors = [t if isinstance(t, torch.Tensor) and t.dim() == 4 else None for t in (q, k, v)]
        lengths = [t.shape[2] if t is not None else -1 for t in tensors]
        shapes = [(tuple(t.shape[:2]) + tuple(t.shape[3:]), str(t.dtype)) if t is not None
                  else None for t in tensors]
        seed = -1  # also where the seed is malformed: that rank refuses the call
        if isinstance(dropout_seed, int) and not isinstance(dropout_seed, bool) \
                and 0 <= dropout_seed < 2 ** 32:
            seed = dropout_seed
        has_dropout = is_kernel and bool(kernel.variant.dropout)  # else neither matters
        records = torch.is_grad_enabled() and any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v, *inputs.values()))
        fields = [int(refused),
                  SCHEMES.index(scheme) + 1 if scheme in SCHEMES else 0,
                  int(kernel.key[:15], 16) if is_kernel else 0,
                  int(training is True) if has_dropout else -1,
                  seed if has_dropout and training is True else -1,
                  *lengths,
                  _crc(shapes),
                  int(records)]
        names, checksums = [], []
        if is_kernel and not refused:
            for decl in kernel.variant.inputs:
                sums = _checksum_once(inputs[decl.name])
                if len(names) < INPUT_SLOTS:
                    names.append(decl.name)
                    checksums.append(sums)
                else:
                    names[-1] = f"{names[-1]}, {decl.name}"
                    checksums[-1] = checksums[-1] + sums.to(checksums[-1].device)
        return cls(fields, names, checksums)

    def tensor(self, device) -> torch.Tensor:
        """int64 [_SIGNATURE_LEN] on `device`: unused input slots are 0."""
        out = torch.zeros(_SIGNATURE_LEN, dtype=torch.int64, device=device)
        out[:len(SIGNATURE_FIELDS)] = torch.tensor(self.fields, dtype=torch.int64)
        if self.checksums:
            sums = torch.cat([c.to(device) for c in self.checksums])
            out[len(SIGNATURE_FIELDS):len(SIGNATURE_FIELDS) + sums.numel()] = sums
        return out


def _crc(value) -> int:
    """A stable hash of a value's repr (Python's hash() differs between processes)."""
    return zlib.crc32(repr(value).encode())


# Checksums of input tensors by id: every layer of a model passes the same document ids
# (and a parameter is unchanged between its layer's calls), so each is summed once while
# it lives unmodified. The weak reference tells a live tensor from a new one at a reused
# id; the version counter sees in-place changes (not writes through .data).
_CHECKSUMS: dict = {}
_CHECKSUMS_SIZE = 64


def _checksum_once(t: torch.Tensor) -> torch.Tensor:
    """`_checksum(t)`, reused while t is alive and unmodified."""
    entry = _CHECKSUMS.get(id(t))
    if entry is not None and entry[0]() is t and entry[1] == t._version:
        return entry[2]
    sums = _checksum(t)
    if len(_CHECKSUMS) >= _CHECKSUMS_SIZE:
        _CHECKSUMS.pop(next(iter(_CHECKSUMS)))
    _CHECKSUMS[id(t)] = (weakref.ref(t), t._version, sums)
    return sums


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """int64 [CHECKSUM_WORDS] on t's device: a hash of its shape and dtype, and two
    sums of its bits in 16-bit words, plain and position-weighted (a changed value
    changes the first, moved values the second). Exact integer sums: the same on every
    device and in any reduction order, and no overflow below 2**31 words."""
    t = t.detach()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    words = t.reshape(-1).view(bits).to(torch.int64)
    words = torch.stack([(words >> shift) & 0xFFFF for shift in range(0, 8 * t.element_size(), 16)]
                        ) if t.element_size() > 2 else words & 0xFFFF
    words = words.reshape(-1)
    index = torch.arange(words.numel(), device=words.device, dtype=torch.int64)
    weights = (index * 40503) % 65521 + 1  # below 2**16, not a multiple of 16 bits' period
    meta = torch.tensor([_crc((tuple(t.shape), str(t.dtype)))], dtype=torch.int64,
                        device=words.device)
    return torch.cat([meta, words.sum().reshape(1), (words * weights).sum().reshape(1)])


def agree(signature: Signature, refusal: CallError | None, group=None, device=None) -> None:
    """Gather every rank's signature (one all-gather of a few int64 per rank) and raise
    the same CallError on every rank where a rank refused the call or the ranks
    disagree; return where the call may go ahead. `device`: the call's (q's), where
    the backend needs the signature on a GPU (NCCL)."""
    world = dist.get_world_size(group)
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:  # NCCL alone: the signature on a GPU
        if device is None or device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    mine = signature.tensor(device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    rows = torch.stack(gathered).tolist()
    by_field = {name: [row[i] for row in rows] for i, name in enumerate(SIGNATURE_FIELDS)}
    # Whatever makes the ranks' own checks disagree comes first: the scheme, the
    # kernel, and the shard lengths the whole sequence is computed from.
    message = _structural_disagreement(by_field)
    if message is not None:
        raise CallError(message)
    refused = [r for r in range(world) if by_field["refused"][r]]
    if refused:
        reasons = [None] * world
        dist.all_gather_object(reasons, str(refusal) if refusal is not None else None,
                               group=group)
        if refusal is not None:
            raise CallError(str(refusal))
        first = refused[0]
        raise CallError(f"rank {first} refused this context_parallel_attention call, so every "
                        f"rank refuses it: {reasons[first]}")
    for name in ("training", "dropout_seed", "shapes", "records_backward"):
        values = by_field[name]
        if len(set(values)) > 1:
            raise CallError(_differs(name, values))
    base = len(SIGNATURE_FIELDS)
    for slot, name in enumerate(signature.input_names):
        words = [tuple(row[base + CHECKSUM_WORDS * slot: base + CHECKSUM_WORDS * (slot + 1)])
                 for row in rows]
        if len(set(words)) > 1:
            raise CallError(f"input {name!r} differs between ranks ({_groups(words)}): every "
                            "input is passed the same on every rank, whole for the global "
                            "sequence on position axes (Sharding.unshard_inputs builds them "
                            "from shards), as a replicated parameter elsewhere")


def _structural_disagreement(by_field: dict) -> str | None:
    """The message of a disagreement that makes the ranks' own checks disagree, or None."""
    schemes = by_field["scheme"]
    if len(set(schemes)) > 1:
        names = {0: "not a scheme"} | {i + 1: repr(s) for i, s in enumerate(SCHEMES)}
        said = ", ".join(f"rank {r} {names[s]}" for r, s in enumerate(schemes))
        return (f"the ranks pass different schemes ({said}); every rank must call with the "
                "same scheme, the one its shards were cut with")
    if len(set(by_field["kernel"])) > 1:
        return (f"the ranks call different kernels ({_groups(by_field['kernel'])}); every "
                "rank must call with the same variant and params")
    for axis in ("len_q", "len_k", "len_v"):
        lengths = by_field[axis]
        if min(lengths) < 0 or len(set(lengths)) == 1:
            continue  # a rank without a 4-d tensor refuses the call with the kernel's message
        held = ", ".join(f"rank {r} {n}" for r, n in enumerate(lengths))
        empty = [r for r, n in enumerate(lengths) if n == 0]
        what = (f"rank{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))} "
                f"hold{'' if len(empty) > 1 else 's'} an empty shard" if empty
                else "the shards have different lengths")
        name = axis[-1]
        return (f"{what} ({name} positions per rank: {held}); context parallelism takes one "
                "non-empty shard of the same length on every rank, because its pieces have one "
                "length, which sizes every transfer and piece pair: pad the sequence to a "
                "multiple of the pieces (2 per rank with zigzag, 1 with contiguous; a mask "
                "that keeps the padding out, e.g. a document id of its own) and cut it with "
                "Sharding.shard")
    return None


def _differs(name: str, values: list) -> str:
    what = {"training": ("training", "pass the same training= on every rank"),
            "dropout_seed": ("dropout_seed", "pass the same dropout_seed on every rank, so that "
                             "every rank drops the bits the whole sequence's call would"),
            "shapes": ("the batch, heads, head dim or dtype of q, k, v",
                       "every rank holds a shard of the same tensors"),
            "records_backward": ("whether the call records a backward (grad mode, "
                                 "requires_grad)", "every rank runs the backward together, so "
                                 "enable gradients and requires_grad alike on every rank")}[name]
    shown = ", ".join(f"rank {r} {v}" for r, v in enumerate(values)) \
        if name in ("training", "dropout_seed") else _groups(values)
    return f"{what[0]} differs between ranks ({shown}); {what[1]}"


def _groups(values: list) -> str:
    """'ranks 0, 2 hold one value; rank 1 another': the ranks grouped by value."""
    groups: dict = {}
    for r, value in enumerate(values):
        groups.setdefault(value, []).append(r)
    said = []
    for i, ranks in enumerate(groups.values()):
        who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
        said.append(f"{who} {'hold' if len(ranks) > 1 else 'holds'} one value" if i == 0
                    else f"{who} another")
    return "; ".join(said)


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call, q, k, v, *input_values):
        inputs = dict(zip(call.input_names, input_values))
        out, lse = call.forward(q, k, v, inputs)
        ctx.save_for_backward(q, k, v, out, lse, *input_values)
        ctx.call = call
        # The merged LSE is differentiable; an unread one's gradient comes as None.
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *input_values = ctx.saved_tensors
        call = ctx.call
        if dout is None and dlse is None:
            return (None,) * (4 + len(input_values))
        if dout is None:  # a loss of the LSE alone
            dout = torch.zeros_like(out)
        inputs = dict(zip(call.input_names, input_values))
        dq, dk, dv, dinputs = call.backward(q, k, v, out, lse, dout, dlse, inputs)
        return (None, dq, dk, dv, *[dinputs.get(n) for n in call.input_names])


def _without_sink(kernel):
    """The kernel of `kernel`'s variant less its `sink`, which the piece pairs run: the
    sink is one logit per row, merged once after the last hop, not once per pair.
    Compiled on first use and kept with the kernel."""
    from .runtime.kernel import Kernel
    pieces = getattr(kernel, "_context_parallel_pieces", None)
    if pieces is None:
        pieces = Kernel(dataclasses.replace(kernel.variant, sink=None),
                        backend=kernel.requested_backend)
        kernel._context_parallel_pieces = pieces
    return pieces


class _RingAttention:
    """One context-parallel call: the hops of its forward and of its backward."""

    def __init__(self, kernel, schedule: Schedule, group, options: CallOptions,
                 input_names: list, problem: Problem, sink_variant: ir.Variant | None = None):
        self.kernel, self.module, self.schedule = kernel, kernel.module, schedule
        # A variant with a sink: the kernel runs it without, and the sink is merged once.
        self.sink_variant = sink_variant
        # The call's options; each piece pair's are these at the pair's offsets.
        self.group, self.options, self.input_names = group, options, input_names
        self.problem = problem  # the whole sequence
        self.sharding = schedule.sharding
        self.c = schedule.piece_len
        # Tile tables per piece pair (absolute offsets), built in the forward and reused
        # by the backward: the inputs they read are saved tensors, which autograd
        # refuses to see modified in between.
        self.tables: dict | None = {} if self.module.USES_TABLES else None

    # ---------------------------------------------------------------- communication
    def _peer(self, group_rank: int) -> int:
        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

    def _post(self, sends: list, recvs: list, tag: int) -> list:
        """Batched isend/irecv of (tensor, group rank) lists; tags keep gloo's matching
        apart (NCCL matches in order, which is the same on every rank)."""
        ops = [dist.P2POp(dist.isend, t, peer=self._peer(r), group=self.group, tag=tag + i)
               for i, (t, r) in enumerate(sends)]
        ops += [dist.P2POp(dist.irecv, t, peer=self._peer(r), group=self.group, tag=tag + i)
                for i, (t, r) in enumerate(recvs)]
        return dist.batch_isend_irecv(ops) if ops else []

    def _post_keys(self, hop: int, k, v):
        """Start hop `hop`'s key/value transfer: ours to rank + hop, rank - hop's to us."""
        s, W, r = self.schedule, self.sharding.world_size, self.sharding.rank
        sends = [(k, (r + hop) % W), (v, (r + hop) % W)] if s.sends(hop) else []
        recvs = []
        if s.receives(hop):
            recvs = [(torch.empty_like(k), s.source(hop)), (torch.empty_like(v), s.source(hop))]
        works = self._post(sends, recvs, tag=4 * hop)
        return works, tuple(t for t, _ in recvs)

    def _visits(self, k, v, hops: list):
        """Yield (hop, keys, values) for each hop of `hops` in order (0: our own; None
        where nothing is received), posting the next hop's transfer before handing out
        the current keys, so that it travels while the caller computes."""
        remote = [h for h in hops if h > 0]
        pending = {}

        def post(index):
            if index < len(remote):
                pending[remote[index]] = self._post_keys(remote[index], k, v)
        post(0)
        posted = 1
        for hop in hops:
            if hop == 0:
                yield 0, k, v
                continue
            post(posted)
            posted += 1
            works, received = pending.pop(hop)
            for w in works:  # each work is waited once: a second wait hangs with gloo
                w.wait()
            yield (hop, *received) if received else (hop, None, None)

    # ---------------------------------------------------------------- kernel calls
    def _pair_problem(self, q_offset, k_offset) -> Problem:
        """One piece pair's call: what the tuner keys its config by."""
        return dataclasses.replace(self.problem, len_q=self.c, len_k=self.c, q_offset=q_offset,
                                   k_offset=k_offset)

    def _pair_offsets(self, hop, i, j) -> tuple:
        """(q_offset, k_offset, tables) of local query piece i and visiting key piece j."""
        c, sharding = self.c, self.sharding
        q_offset = sharding.pieces[i] * c
        k_offset = sharding.pieces_of(self.schedule.source(hop))[j] * c
        tables = None
        if self.tables is not None:
            tables = self.tables.setdefault((q_offset, k_offset), {})
        return q_offset, k_offset, tables

    def _pair_launch(self, hop, i, j, direction, args) -> tuple:
        """(problem, run, config) of the pair call `direction` ("fwd", "dq" or "dkdv") on
        local query piece i and visiting key piece j at their absolute offsets, with the
        backend and config the tuner chose for it; `run(config)` launches it. Each is the
        kernel a single-device call of the pair would run (`Kernel.forward_role`,
        `Kernel.backward_role`: on Hopper the Gluon kernel where it takes the call and
        was measured faster)."""
        q_offset, k_offset, tables = self._pair_offsets(hop, i, j)
        options = dataclasses.replace(self.options, q_offset=q_offset, k_offset=k_offset)
        common = options.launch_arguments(tables)
        problem = self._pair_problem(q_offset, k_offset)
        if direction == "fwd":
            role = self.kernel.forward_role(*args, common)
        else:
            # dQ or dK/dV of the pair, on whichever backend a single-device backward of
            # this pair would run (delta is computed once for the merged output, so the
            # dQ kernel reads it rather than deriving it from an output).
            role = self.kernel.backward_role(direction, *args, common)
        run, config = self.kernel.choose(role, problem, args[0].dtype)
        return problem, run, config

    def _pair_call(self, hop, i, j, direction, *args):
        """Run one piece pair's call with the tuned config of its direction."""
        problem, run, config = self._pair_launch(hop, i, j, direction, args)
        return tuning.launch(self.kernel, problem, args[0].dtype, direction, run, config)

    def _tune_before_transfers(self, calls_of):
        """Decide the configs of the calls `calls_of(q_piece, k_piece)` gives
        ([(direction, args)]) on our first own pair, before any transfer is posted.
        Every pair shares the tuning key of its piece length, so on a first call this is
        where candidates are timed, on a pair that stands for the heavy ones, and not
        beside NCCL's kernels (RESULTS.md runs 96-98: tuned on whichever pair came first,
        the pieces' forward once kept a config 12% slower). Later calls find the configs
        in memory here."""
        own = self.schedule.pairs(0)
        if not own:
            return
        # A wholly attended pair where there is one: the most work a pair of this tuning
        # key can hold (a causal diagonal pair times candidates within 1% of each other).
        sharding = self.sharding
        whole = [(i, j) for i, j in own
                 if self.schedule.wholly_attended[sharding.pieces[i]][sharding.pieces[j]]]
        i, j = (whole or own)[0]
        for direction, args in calls_of(i, j):
            self._pair_launch(0, i, j, direction, args)

    # ---------------------------------------------------------------- forward
    def forward(self, q, k, v, inputs):
        c, W = self.c, self.sharding.world_size
        k, v = k.contiguous(), v.contiguous()
        B, H, L, _ = q.shape
        # The merged output (v's head dim wide) and natural LSE of each local query row, in fp32.
        acc = torch.zeros((B, H, L, v.shape[3]), device=q.device, dtype=torch.float32)
        acc_lse = torch.full((B, H, L), float("-inf"), device=q.device, dtype=torch.float32)
        merged = set()  # local query pieces that hold a partial result already
        self._tune_before_transfers(lambda i, j: [(
            "fwd", (q.narrow(2, i * c, c), k.narrow(2, j * c, c), v.narrow(2, j * c, c),
                    inputs))])
        for hop, keys, values in self._visits(k, v, list(range(W))):
            for i, j in self.schedule.pairs(hop):
                out, lse = self._pair_call(hop, i, j, "fwd", q.narrow(2, i * c, c),
                                           keys.narrow(2, j * c, c), values.narrow(2, j * c, c),
                                           inputs)
                rows, rows_lse = acc.narrow(2, i * c, c), acc_lse.narrow(2, i * c, c)
                if i in merged and self.kernel.variant.normalize == ir.UNNORMALIZED:
                    rows.add_(out)  # `normalize none`: the pieces' outputs add up
                elif i in merged:
                    merge_partial(rows, rows_lse, out, lse)
                else:  # the first partial is the result so far
                    rows.copy_(out)
                    rows_lse.copy_(lse)
                    merged.add(i)
        if self.sink_variant is not None:  # one extra logit per row, merged once
            sinks.merge_sink(self.sink_variant, self.problem, inputs, acc, acc_lse,
                             self.sharding.positions(self.problem.len_q, q.device))
        return acc.to(q.dtype), acc_lse

    # ---------------------------------------------------------------- backward
    def backward(self, q, k, v, out, lse, dout, dlse, inputs):
        s, c, module = self.schedule, self.c, self.module
        W, r = self.sharding.world_size, self.sharding.rank
        dout = dout.contiguous()
        k, v = k.contiguous(), v.contiguous()
        # delta = rowsum(dO * O) of the merged output, as the single-device backward has it,
        # minus the merged LSE's gradient where one flows: every pair's P is relative to
        # the merged LSE, so d LSE_i / d s_ij = P_ij over every piece's keys, and the pairs'
        # dQ and dK/dV kernels carry it through delta.
        if dlse is not None:
            dlse = dlse.contiguous()
        delta = module.backward_delta(out, dout, lse=lse, dlse=dlse)
        # The kernels read LSE and delta as contiguous [B * H, len_q] rows: one per piece.
        n_local = len(self.sharding.pieces)
        lse_of = [lse.narrow(2, i * c, c).contiguous() for i in range(n_local)]
        delta_of = [delta.narrow(2, i * c, c).contiguous() for i in range(n_local)]
        dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
        dk = torch.zeros(k.shape, device=k.device, dtype=torch.float32)
        dv = torch.zeros(v.shape, device=v.device, dtype=torch.float32)
        dinputs: dict = {}

        def pair_args(i, j, keys, values):
            return (q.narrow(2, i * c, c), keys.narrow(2, j * c, c), values.narrow(2, j * c, c),
                    lse_of[i], delta_of[i], dout.narrow(2, i * c, c), inputs)
        self._tune_before_transfers(lambda i, j: [
            ("dq", pair_args(i, j, k, v)),
            ("dkdv", pair_args(i, j, k, v))])
        # Our own pieces' pairs are split: the first is computed while the first keys
        # travel, the others while the last hop's dK/dV travel home.
        own = s.pairs(0)
        plan = [(0, own)] if W == 1 else (
            [(0, own[:1])] + [(hop, s.pairs(hop)) for hop in range(1, W)] + [(0, own[1:])])
        sent, returning = [], None  # returning: the last hop's dK/dV on their way home
        visits = self._visits(k, v, [hop for hop, _ in plan])
        for (hop, pairs), (_, keys, values) in zip(plan, visits):
            if hop == 0:
                dk_hop, dv_hop = dk, dv
            elif pairs:  # dK/dV of the visiting pieces, returned to their owner below
                dk_hop = torch.zeros(keys.shape, device=k.device, dtype=torch.float32)
                dv_hop = torch.zeros(values.shape, device=v.device, dtype=torch.float32)
            for i, j in pairs:
                args = pair_args(i, j, keys, values)
                dq_pair, dinputs_pair = self._pair_call(hop, i, j, "dq", *args)
                dk_pair, dv_pair, *by_keys = self._pair_call(hop, i, j, "dkdv", *args)
                if by_keys:  # learnable reads of keys alone: the dK/dV programs own them
                    dinputs_pair = {n: g + by_keys[0][n] for n, g in dinputs_pair.items()}
                dq.narrow(2, i * c, c).add_(dq_pair)
                dk_hop.narrow(2, j * c, c).add_(dk_pair)
                dv_hop.narrow(2, j * c, c).add_(dv_pair)
                for name, g in dinputs_pair.items():
                    dinputs[name] = g if name not in dinputs else dinputs[name] + g
            if hop == 0:
                continue
            # Send the visiting pieces' dK/dV home, and receive ours from rank + hop,
            # which computed with our keys at this hop.
            home, helper = s.source(hop), (r + hop) % W
            sends = [(dk_hop, home), (dv_hop, home)] if s.receives(hop) else []
            recvs = []
            if s.sends(hop):
                recvs = [(torch.empty_like(dk), helper), (torch.empty_like(dv), helper)]
            works = self._post(sends, recvs, tag=4 * hop + 2)
            if returning is not None:  # the previous hop's: at most two in flight
                self._add_returned(*returning, dk, dv)
            returning = (works, [t for t, _ in recvs]) if recvs else None
            if not recvs:
                sent += works
        if returning is not None:
            self._add_returned(*returning, dk, dv)
        for w in sent:
            w.wait()
        if self.sink_variant is not None:  # σ's gradient, from the merged rows' delta
            dinputs = sinks.add_sink_gradients(
                self.sink_variant, self.problem, inputs, lse, delta, dinputs,
                self.sharding.positions(self.problem.len_q, q.device))
        for name in self.input_names:
            if self.kernel.variant.input(name).learnable and name not in dinputs:
                dinputs[name] = torch.zeros_like(inputs[name])  # no pair ran on this rank
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dinputs

    @staticmethod
    def _add_returned(works, buffers, dk, dv):
        dk_part, dv_part = buffers
        for w in works:
            w.wait()
        dk.add_(dk_part)
        dv.add_(dv_part)


def merge_partial(acc, acc_lse, out, lse):
    """Merge a partial attention (out, lse) over other keys into (acc, acc_lse), in
    place and exactly: softmax over the union of two disjoint key sets (and `normalize
    sum`'s, whose LSE is log of the sum of weights). Rows with no
    allowed key have LSE -inf and output 0 on either side, and stay NaN-free."""
    new_lse = torch.logaddexp(acc_lse, lse)  # -inf only where both are
    base = torch.where(new_lse == float("-inf"), 0.0, new_lse)
    acc.mul_(torch.exp(acc_lse - base).unsqueeze(-1))
    acc.addcmul_(out, torch.exp(lse - base).unsqueeze(-1))
    acc_lse.copy_(new_lse)
