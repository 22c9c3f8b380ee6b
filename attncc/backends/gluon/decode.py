"""What the Gluon MLA decode kernel (templates/decode_mla.jinja) takes, its configs, and
why it refuses the rest: each refusal a sentence that `backend="gluon"` raises and that
auto reports while the portable decode runs the call (attncc/runtime/decoding.py).

The kernel is FlashMLA's division of the work for two shapes: keys 576 wide (512 + 64
column segments) whose first 512 columns are the values (v a view of k: one latent
cache), and keys 64 wide beside a separate v cache 512 wide; 64 query rows a program on
two warpgroups, key tiles of 64.
"""
from __future__ import annotations

from ... import ir

BACKEND = "gluon"  # the backend whose module holds the kernel; a config's "backend" names it
# (q·k, v) head dims: MLA's latent cache (DeepSeek-V2/V3: 512 latent + 64 rope columns),
# whose values must be the keys' first columns, and (64, 512) with a v cache of its own.
LATENT = (576, 512)
PAIRS = (LATENT, (64, 512))
DTYPES = ("float16", "bfloat16")
ROWS = 64  # BLOCK_M: query rows (heads x new tokens) a program owns
BLOCK_N = 64  # keys a tile
NUM_WARPS = 8  # two warpgroups side by side: each owns 256 of O's 512 columns
NUM_STAGES = 2  # key tiles in the ring


def shared_bytes(dim: int, dim_v: int, v_is_k: bool) -> int:
    """Shared memory of one program's tiles (bytes): Q (64 x dim) and NUM_STAGES key
    tiles (64 x dim, and 64 x dim_v of values unless the keys hold them) in 16-bit. At
    576 / 512 that is 221184 B of Hopper's 232448 (227 KB): one program an SM; the rest
    holds P's layout change to the second product's operand and the barriers."""
    return (ROWS * dim + NUM_STAGES * BLOCK_N * (dim + (0 if v_is_k else dim_v))) * 2


def variant_refusal(variant: ir.Variant) -> str | None:
    """Why the Gluon MLA decode cannot run any decode call of `variant`, or None. It
    evaluates the variant's mask and score on every key tile it visits from the names a
    decode row has (positions, head, batch, lengths), under softmax."""
    if variant.inputs:
        names = ", ".join(d.name for d in variant.inputs)
        return (f"variant '{variant.name}' reads input tensors ({names}); the Gluon MLA decode "
                "takes masks and scores of positions, heads and lengths only")
    if variant.layout is not None:
        return (f"variant '{variant.name}' has a block layout; the Gluon MLA decode has no "
                "tile skipping by layout")
    if variant.normalize != ir.SOFTMAX:
        return (f"variant '{variant.name}' normalizes by `{variant.normalize}`; the Gluon MLA "
                "decode computes softmax only")
    if variant.sink is not None:
        return f"variant '{variant.name}' has a sink; the Gluon MLA decode has none"
    return None


def call_refusal(p, dtype, k_cache, v_cache, v_is_k: bool) -> str | None:
    """Why the Gluon MLA decode cannot take this call (a runtime DecodeProblem `p`), or
    None. The caches are read by TMA: their head dim contiguous, their other strides and
    base 16-byte aligned."""
    dims = (p.dim, p.dim if p.dim_v is None else p.dim_v)
    if dims not in PAIRS:
        return (f"q·k is {dims[0]} wide and v {dims[1]}; the Gluon decode takes (q·k, v) "
                f"{' and '.join(map(str, PAIRS))} only (the portable decode takes any)")
    if dims == LATENT and not v_is_k:
        return (f"v_cache is not a view of k_cache's first {LATENT[1]} columns; at "
                f"{LATENT} the Gluon MLA decode reads the values from the key tiles (pass "
                "v_cache=k_cache[..., :512])")
    name = str(dtype).replace("torch.", "")
    if name not in DTYPES:
        return f"the cache is {name}; the Gluon MLA decode takes float16 and bfloat16"
    if p.page_size and p.page_size % BLOCK_N:
        return (f"pages hold {p.page_size} positions; the Gluon MLA decode copies whole key "
                f"tiles of {BLOCK_N} from one page, so it needs pages of a multiple of {BLOCK_N}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        size = t.element_size()
        if t.stride(3) != 1 or any((s * size) % 16 for s in t.stride()[:3]) or t.data_ptr() % 16:
            return (f"{name} has strides {tuple(t.stride())}: the Gluon MLA decode's bulk "
                    "copies need the head dim contiguous and 16-byte aligned rows")
    if p.group * p.n_q * dims[1] >= 2 ** 31:
        return (f"{p.group} query heads a kv head x {p.n_q} new tokens x {dims[1]} output "
                "columns pass 2**31; the Gluon MLA decode indexes a group's outputs in 32 bits")
    return None


def candidates(p, n_sm: int, num_splits: int | None) -> list:
    """The kernel's configs (decoding.CONFIG_KEYS and backend "gluon"), most likely winner
    first: splits that fill one wave of one program an SM (shared memory), at least four
    key tiles a split; and half and twice that."""
    programs = p.batch * p.heads_kv * -(-p.group * p.n_q // ROWS)
    tiles = -(-p.capacity // BLOCK_N)
    base = num_splits or max(1, min(n_sm // programs, tiles // 4, 256))
    splits = [base] if num_splits else list(dict.fromkeys([base, max(1, base // 2), min(256, base * 2)]))
    return [dict(BLOCK_N=BLOCK_N, num_warps=NUM_WARPS, num_stages=NUM_STAGES, num_splits=s,
                 backend=BACKEND) for s in splits]


def config_refusal(config: dict) -> str | None:
    """Why a pinned config cannot run the Gluon MLA decode, or None."""
    shape = (config["BLOCK_N"], config["num_warps"], config["num_stages"])
    if shape != (BLOCK_N, NUM_WARPS, NUM_STAGES):
        return (f"config BLOCK_N {shape[0]}, num_warps {shape[1]}, num_stages {shape[2]}: the "
                f"Gluon MLA decode runs BLOCK_N {BLOCK_N}, num_warps {NUM_WARPS}, num_stages "
                f"{NUM_STAGES} (its shared memory holds Q and two key tiles)")
    return None
