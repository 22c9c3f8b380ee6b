"""A tile config: the tile sizes, warps and pipeline stages one kernel launch runs with.

Typed and frozen, so that the runtime compares, caches and reports configs as values. It
is written as the dict users pin (`config=`, ATTNCC_CONFIG) and the tuning cache stores,
{"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}, which is also what a generated module
takes: `from_dict` reads it, `as_dict` writes it. The rules here hold for every backend;
what one backend's kernels take beyond them (the warps, the shared memory) is its own
`check_config` (backends/base.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import ir

KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
EXAMPLE = '{"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}'
# The one BLOCK_M that is no power of two: the Gluon forward's three consumer warpgroups
# of 64 rows (backends/gluon/tiles.py); the other kernels refuse it in their checks.
THREE_WARPGROUPS = 192


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # query rows per tile
    block_n: int  # key rows per tile
    num_warps: int
    num_stages: int  # software pipeline depth

    @classmethod
    def from_dict(cls, config, where: str) -> "TileConfig":
        """A config given as a dict, checked: tiles powers of two from 16 to 256 (BLOCK_M
        192 too: three 64-row warpgroups, the Gluon forward's), warps from 1 to 16, stages
        from 1 to 8; a ValueError naming `where` and the rule."""
        if not isinstance(config, dict) or set(config) != set(KEYS):
            raise ValueError(f"{where} must be a dict with exactly the keys {sorted(KEYS)}, "
                             f"got {config!r}")
        for key in ("BLOCK_M", "BLOCK_N"):
            v = config[key]
            if key == "BLOCK_M" and v == THREE_WARPGROUPS:
                continue
            if not _is_int(v) or v < 16 or v > 256 or v & (v - 1):
                also = f" (or {THREE_WARPGROUPS})" if key == "BLOCK_M" else ""
                raise ValueError(f"{where}: {key} must be a power of two from 16 to 256{also}, "
                                 f"got {v!r}")
        if not _is_int(config["num_warps"]) or not 1 <= config["num_warps"] <= 16:
            raise ValueError(f"{where}: num_warps must be an int from 1 to 16, "
                             f"got {config['num_warps']!r}")
        if not _is_int(config["num_stages"]) or not 1 <= config["num_stages"] <= 8:
            raise ValueError(f"{where}: num_stages must be an int from 1 to 8, "
                             f"got {config['num_stages']!r}")
        return cls(config["BLOCK_M"], config["BLOCK_N"], config["num_warps"],
                   config["num_stages"])

    def as_dict(self) -> dict:
        """The dict form: what a generated module's `config=` takes and the cache stores."""
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, num_warps=self.num_warps,
                    num_stages=self.num_stages)

    def within(self, block: int) -> bool:
        """Whether every tile lies inside one layout block of `block` positions (a power
        of two): both sides divide it (a 192-row tile fits no block)."""
        return block % self.block_m == 0 and block % self.block_n == 0

    def label(self) -> str:
        """As progress lines write it: 128x128 w8 s3."""
        return f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}"

    def describe(self) -> str:
        """As error messages write it: BLOCK_M=128 BLOCK_N=128 warps=8 stages=3."""
        return (f"BLOCK_M={self.block_m} BLOCK_N={self.block_n} warps={self.num_warps} "
                f"stages={self.num_stages}")

    def sentence(self) -> str:
        """As `attncc compile` reports it: 128x128 (8 warps, 3 stages)."""
        s = self.num_stages
        return (f"{self.block_m}x{self.block_n} ({self.num_warps} warps, "
                f"{s} stage{'s' if s != 1 else ''})")


def needs_tiles_within_block(variant: ir.Variant) -> bool:
    """Whether every kernel tile must nest in one of the variant's layout blocks. An index
    list (`kb in t[...]`) says which blocks are on, not which positions, so each tile must
    be on or off as a whole; other layouts are evaluated per element in tiles that span
    several blocks."""
    return variant.block is not None and bool(ir.index_lists(variant.layout))


def fits_variant(config: TileConfig, variant: ir.Variant) -> bool:
    """Whether the variant's layout lets kernels run `config` correctly."""
    return not needs_tiles_within_block(variant) or config.within(variant.block)
