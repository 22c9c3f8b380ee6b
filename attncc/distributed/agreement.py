"""What every rank of a context-parallel call must agree on, checked before any transfer
(attncc/distributed).

Every rank must call with shards of one length, the same scheme, kernel, batch, heads,
dtype, inputs and (with dropout) dropout_seed, and all record a backward or none. Before
any transfer, one all-gather of a few int64 per rank (`Signature`: those fields and a
checksum of each input) checks it, and also carries whether the rank's own checks
refused the call: a refusal or a disagreement raises the same CallError on every rank
(`agree`), so no rank waits on a transfer that never comes, and none computes with
buffers sized from another rank's length. Uneven shards are refused, not supported: the
pieces have one length, which sizes every transfer and piece pair.
"""
from __future__ import annotations

import weakref
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import CallError
from .sharding import SCHEMES


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
        from ..runtime.kernel import Kernel
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
    if t.is_inference():  # no version counter to see a write by: summed every call
        return _checksum(t)
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
