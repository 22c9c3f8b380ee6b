"""Which pieces of one sequence each rank of a group holds (attncc/distributed).

"contiguous" gives rank r the r-th of W equal pieces. "zigzag" cuts the sequence into
2W pieces and gives rank r pieces r and 2W-1-r, so that under a causal mask every rank
has the same work (ring-flash-attention's scheme).

Inputs the variant reads on position axes (q, k, qb, kb: document ids, per-position
tensors) are passed whole, for the global sequence, the same on every rank: they are
O(S), and every piece pair reads them at its own absolute positions. Build them from
shards with `Sharding.unshard_inputs`. Inputs on other axes are passed as usual.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import ir
from ..errors import CallError


SCHEMES = ("zigzag", "contiguous")
POSITION_AXES = ("q", "k")
BLOCK_AXES = ("qb", "kb")


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
        rank = dist.get_rank(group)
        if rank < 0:  # torch's answer for a process outside `group`
            raise CallError(f"this process (global rank {dist.get_rank()}) is not in the group "
                            "it passed; call with a group it belongs to (every rank of the "
                            "group calls, and only those)")
        return cls(scheme, dist.get_world_size(group), rank)

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
