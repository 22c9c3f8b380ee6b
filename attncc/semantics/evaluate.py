"""Dense evaluation of IR expressions with PyTorch, broadcasting over index grids.

The reference computes attention with it, and the tests use it as the dense ground
truth for tile classification. Each operation means what its `torch` column in
attncc/operators.py says (`//` floors and `%` takes the sign of the divisor, as in
Python; `/` is true division), as the kernels compute it.
"""
from __future__ import annotations

import torch

from .. import ir
from ..errors import CallError
from ..operators import entry_of


def check_index_list(name: str, tensor: torch.Tensor, n_tiles: int):
    """An index list input holds, per list, distinct tile indices in [0, n_tiles) and -1
    for padding. Reads the values: one host synchronisation."""
    rows = tensor.long()
    bad = (rows < -1) | (rows >= n_tiles)
    if bool(bad.any()):
        value = int(rows[bad][0])
        raise CallError(f"input '{name}' holds tile index {value}, outside [0, {n_tiles}) for "
                        "these shapes; index lists hold tile indices and -1 for padding")
    ordered = rows.sort(-1).values
    repeated = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    if bool(repeated.any()):
        value = int(ordered[..., 1:][repeated][0])
        raise CallError(f"input '{name}' lists tile {value} twice in one list; each list must "
                        "name distinct tiles (pad with -1)")


def evaluate(e, env: dict, *, float_dtype=torch.float64, gather=None, gate=None,
             clamp: bool = False):
    """Evaluate `e`. `env` maps index names to tensors or numbers, and holds
    `params` (name -> value) and `inputs` (name -> tensor). `gather(tensor, indices)`,
    where given, reads a tensor's elements at broadcast index tensors instead of
    `tensor[indices]` (the sink's gradient reduces through a fixed-order read).

    `gate` (bool, broadcastable against the values): where gradients may flow. Outside
    it, and in each branch of a `where` where the branch is not taken, the differentiable
    leaves (s, float inputs) are read detached, so a value that is not used adds exactly
    nothing to a gradient even where its derivative is inf or NaN (0 * inf would be NaN:
    `where(q == k, 0.0, s / (q - k))`, a masked pair's score), as the kernels' derivative
    selects rather than multiplies. The values are the same with or without it.

    An index out of its axis raises a CallError (the reference's rule), or with `clamp`
    is clamped into it, as the kernels read: what runs beside them (a sink's gradient)
    must read the same elements."""
    return _Evaluator(env, float_dtype, gather, gate, clamp).run(e)


class _Evaluator(ir.Visitor):
    def __init__(self, env, float_dtype, gather=None, gate=None, clamp=False):
        self.env = env
        self.clamp = clamp
        self.float_dtype = float_dtype
        self.gather = gather or (lambda tensor, indices: tensor[indices])
        self.gate = gate

    def _gated(self, x):
        """x, its gradient kept only where the gate is open."""
        if self.gate is None or not (isinstance(x, torch.Tensor) and x.requires_grad):
            return x
        return torch.where(self.gate, x, x.detach())

    def run(self, e):
        return self(e)

    def _num(self, x):
        return x if isinstance(x, torch.Tensor) else torch.tensor(x)

    def Var(self, e):
        return self._gated(self._num(self.env[e.name]))

    def Const(self, e):
        if e.type == ir.FLOAT:
            return torch.tensor(e.value, dtype=self.float_dtype)
        return torch.tensor(e.value)

    def Param(self, e):
        value = self.env["params"][e.name]
        return torch.tensor(value, dtype=self.float_dtype) if isinstance(value, float) else torch.tensor(value)

    def Load(self, e):
        tensor = self.env["inputs"][e.tensor]
        idx = [self.run(i).long() for i in e.indices]
        if self.clamp:
            idx = [i.clamp(0, n - 1) for i, n in zip(idx, tensor.shape)]
        for axis, (i, n) in enumerate(zip(idx, tensor.shape)):
            if i.numel() and (int(i.min()) < 0 or int(i.max()) >= n):
                bad = int(i.min()) if int(i.min()) < 0 else int(i.max())
                raise CallError(f"input '{e.tensor}' is read at index {bad} along axis {axis}, "
                                f"which has length {n}: the spec indexes it out of range "
                                "for these shapes")
        shape = torch.broadcast_shapes(*(i.shape for i in idx))
        out = self.gather(tensor, tuple(i.expand(shape) for i in idx))
        if out.is_floating_point():
            return self._gated(out.to(self.float_dtype))
        # The language's integers are 64-bit: an i8 or i32 read must not make `x[q] * c`
        # wrap in its own dtype (attncc/analysis/ranges.py).
        return out if out.dtype == torch.bool else out.long()

    def Member(self, e):
        tensor = self.env["inputs"][e.tensor]
        n_tiles = self._num(self.env[e.item.name]).numel()  # qb / kb range over every tile
        check_index_list(e.tensor, tensor, n_tiles)
        rows = self.Load(ir.Load(e.tensor, e.indices))  # [..., list length]
        return (rows == self.run(e.item).unsqueeze(-1)).any(-1)

    def _promote(self, a, b):
        if a.is_floating_point() or b.is_floating_point():
            return a.to(self.float_dtype), b.to(self.float_dtype)
        return a, b

    def Where(self, e):
        c = self.run(e.cond)
        a, b = self._promote(self._branch(e.then, c), self._branch(e.other, ~c))
        return entry_of(e).torch(c, a, b, float_dtype=self.float_dtype)

    def _branch(self, e, taken):
        """A branch of a `where`, its gradient gated to where it is taken (see evaluate)."""
        if not torch.is_grad_enabled():
            return self.run(e)
        outer = self.gate
        self.gate = taken if outer is None else outer & taken
        try:
            return self.run(e)
        finally:
            self.gate = outer

    def other(self, e):
        """An operation (attncc/operators.py). The two operands of a binary one (an
        operator, a comparison, min, max) meet in one dtype: a float makes both floats."""
        entry = entry_of(e)
        operands = [self.run(x) for x in ir.children(e)]
        if entry.arity == 2:
            operands = self._promote(*operands)
        return entry.torch(*operands, float_dtype=self.float_dtype)
