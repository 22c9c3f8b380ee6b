"""Which piece pairs each rank computes, and which hops send keys (attncc/distributed).

Which piece pairs may attend is decided with the kernels' own tile classification (the
generated `tile_tables`, with tiles one piece long): a pair is skipped only when no
(q, k) pair in it can attend (conservative, like the kernels' tiles). Hop t brings rank
r the keys of rank r - t, sent by their owner directly (a shift, not a ring that
forwards them), so each hop's transfer is skipped on its own when the receiver has no
pair to compute with them: a sliding window exchanges keys with its neighbours only.
For masks and layouts that read no tensor, the schedule is computed on the host from
shapes alone (no communication, cached); when they read tensors (document ids), each
rank classifies on its device, from inputs the agreement (agreement.py) found the same
on every rank, so every rank makes the same schedule.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..arguments import Problem
from .sharding import Sharding


_SCHEDULES: dict = {}  # schedules of masks that read no tensor, by shape
_SCHEDULES_SIZE = 64


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
