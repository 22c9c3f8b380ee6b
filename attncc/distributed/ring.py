"""The hops of one context-parallel call, forward and backward (attncc/distributed).

Each rank computes its piece pairs hop by hop and merges the partial outputs exactly
through their log-sum-exps (`merge_partial`). The backward sends the keys and values
again; each rank adds dQ for its own queries, and sends the dK/dV it computed for a
visiting piece back to that piece's owner.

Overlap. The next hop's keys and values are posted (`batch_isend_irecv`) before the
current hop is computed, and a hop's dK/dV are posted as soon as they are computed. On
CUDA, the NCCL backend runs point-to-point work on its own stream, which waits for the
current stream where the work is posted, and `wait()` makes the current stream wait for
it, so the transfers overlap the kernels without a stream of our own; with gloo on the
CPU they run on gloo's threads.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .. import ir
from ..arguments import Problem
from ..runtime import sinks, tuning
from ..runtime.call_options import CallOptions
from .schedule import Schedule


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
