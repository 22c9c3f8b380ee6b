"""Context parallelism refuses, on every rank at once, a call whose ranks disagree.

Real gloo processes run scenarios in which the ranks' shards have different lengths,
an empty shard, or an input, the scheme, the dropout seed or a per-call flag differs
between ranks, or one rank's call alone is malformed. Every rank must raise a CallError
naming the cause (never a hang, never an answer on some ranks), and the group stays
usable for the next call. A fuzzer draws random shard lengths (mostly equal, sometimes
not) and per-rank inputs that sometimes differ: every call either equals the
float64 reference on every rank or is refused on every rank.
"""
from __future__ import annotations

import datetime
import math
import os
import random
import re
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

import attncc
from attncc import distributed as cp
from attncc.distributed import agreement
from attncc.errors import CallError
from attncc.semantics.reference import scale_value
from attncc.semantics.tolerance import gradient_scales, max_abs_error, within_tolerance

D = 16
SPECS = {
    "causal": "attention causal { mask q >= k }",
    "document": "attention document { input doc_q: i32[q]  input doc_k: i32[k]  "
                "mask doc_q[q] == doc_k[k] and q >= k }",
    "slopes": "attention slopes { input sl: f32[h]  mask q >= k  score s + sl[h] * (k - q) }",
    "table": "attention table { input t: f32[b, h]  mask q >= k  score s * t[b, h] }",
    "learnable": "attention learn { learnable input w: f32[h]  mask q >= k  score s + w[h] }",
    "dropout": "attention drop { mask q >= k  dropout 0.25 }",
    "bias": "attention bias { input bq: f32[q]  mask q >= k  score s + bq[q] }",
}
HANG_LIMIT = 240  # seconds a spawn may take before the test calls it a hang


def whole_inputs(variant_name: str, S: int, B: int, H: int, gen) -> dict:
    """The whole-sequence inputs of a variant, drawn from `gen`."""
    if variant_name == "document":
        doc = torch.sort(torch.randint(0, 3, (S,), generator=gen)).values.to(torch.int32)
        return {"doc_q": doc, "doc_k": doc.clone()}
    if variant_name == "slopes":
        return {"sl": torch.rand(H, generator=gen)}
    if variant_name == "table":
        return {"t": torch.rand(B, H, generator=gen) + 0.5}
    if variant_name == "learnable":
        return {"w": torch.randn(H, generator=gen)}
    if variant_name == "bias":
        return {"bq": torch.randn(S, generator=gen)}
    return {}


def call(variant_name, scheme, local_len, B, H, seed, inputs, dropout_seed=None, backward=True,
         training=True):
    """One rank's call on its own random shard; returns (out, dq) gathered, or raises. A
    dropout variant gets dropout_seed 7 unless another is given."""
    kernel = attncc.compile(SPECS[variant_name])
    if dropout_seed is None and kernel.variant.dropout:
        dropout_seed = 7
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, local_len, D, generator=gen).requires_grad_(backward)
               for _ in range(3))
    out = cp.context_parallel_attention(kernel, q, k, v, scheme=scheme, training=training,
                                        dropout_seed=dropout_seed, **inputs)
    if backward:
        out.backward(torch.ones_like(out))
    return out, q.grad


# ------------------------------------------------------------------ scenarios
# Each scenario is called on every rank with (rank, world) and returns the arguments of
# that rank's `call`; every rank must raise a CallError matching the pattern.
def _uneven(lengths):
    """Rank r holds lengths[r] positions (8 beyond the list)."""
    return lambda r, w: dict(local_len=(lengths + [8] * w)[r])


def _differs(variant_name, **extra):
    """Whole inputs drawn with a different seed on each rank."""
    def make(r, w):
        S = 8 * w
        inputs = whole_inputs(variant_name, S, 1, 2, torch.Generator().manual_seed(100 + r))
        return dict(variant_name=variant_name, local_len=8, inputs=inputs, **extra)
    return make


SCENARIOS = [
    ("uneven", _uneven([8, 12, 8]), "the shards have different lengths"),
    ("uneven_first", _uneven([12, 8, 8]), r"rank 0 12, rank 1 8"),
    ("one_empty", _uneven([8, 0, 8]), "rank 1 holds an empty shard"),
    ("all_empty", lambda r, w: dict(local_len=0), "this rank's shard is empty"),
    ("document_ids", _differs("document"), "input 'doc_q' differs between ranks"),
    # A document boundary one position apart, inside one piece: the pieces' schedule is
    # the same on every rank, so only the inputs themselves tell the ranks apart.
    ("document_boundary", lambda r, w: dict(
        variant_name="document", local_len=8,
        inputs={n: (torch.arange(8 * w) >= 10 + (r == 1)).to(torch.int32)
                for n in ("doc_q", "doc_k")}),
     "input 'doc_q' differs between ranks"),
    ("score_input", _differs("slopes"), "input 'sl' differs between ranks"),
    ("per_batch_table", _differs("table"), "input 't' differs between ranks"),
    ("learnable", _differs("learnable"), "input 'w' differs between ranks"),
    ("position_bias", _differs("bias"), "input 'bq' differs between ranks"),
    ("scheme", lambda r, w: dict(scheme="contiguous" if r == 1 else "zigzag"),
     "the ranks pass different schemes"),
    ("dropout_seed", lambda r, w: dict(variant_name="dropout", dropout_seed=r),
     "dropout_seed differs between ranks"),
    ("training", lambda r, w: dict(variant_name="dropout", training=r == 0),
     "training differs between ranks"),
    ("backward", lambda r, w: dict(backward=r != w - 1),
     "whether the call records a backward"),
    ("one_rank_malformed", lambda r, w: dict(
        variant_name="document", local_len=8,
        inputs={n: torch.zeros(8 * w if r != 1 else 8, dtype=torch.int32)
                for n in ("doc_q", "doc_k")}),
     r"refused this context_parallel_attention call|passed whole"),
    ("one_rank_bad_scheme", lambda r, w: dict(scheme="ring" if r == 0 else "zigzag"),
     "different schemes"),
]


def run_scenarios(rank, world, init_file, out_dir, fuzz_trials, fuzz_seed):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        outcomes = {}
        for name, make, _ in SCENARIOS:
            args = dict(variant_name="causal", scheme="zigzag", local_len=8, B=1, H=2,
                        seed=rank, inputs={})
            args.update(make(rank, world))
            outcomes[name] = outcome(lambda: call(**args))
        # The group still works after the refusals: an agreed call goes ahead.
        outcomes["agreed_after"] = outcome(
            lambda: call("causal", "zigzag", 2, 1, 1, rank, {}, backward=False))
        trials = [fuzz_trial(rank, world, random.Random(fuzz_seed + i)) for i in range(fuzz_trials)]
        torch.save({"outcomes": outcomes, "trials": trials},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        dist.destroy_process_group()
    except Exception:
        with open(os.path.join(out_dir, f"error-{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise


def outcome(fn):
    """('ok', None) or ('refused', message) or ('error', traceback) of fn()."""
    try:
        fn()
        return ("ok", None)
    except CallError as e:
        return ("refused", str(e))
    except Exception:
        return ("error", traceback.format_exc())


# ------------------------------------------------------------------ the fuzzer
def draw(rng: random.Random, world: int) -> dict:
    """A call every rank draws alike from the shared seed, and what each rank changes."""
    variant_name = rng.choice(["causal", "document", "slopes", "table", "learnable", "dropout",
                               "bias"])
    scheme = rng.choice(cp.SCHEMES)
    n = 2 * world if scheme == "zigzag" else world
    piece = rng.choice([1, 3, 5, 8])
    local = piece * n // world
    B, H = rng.choice([1, 2]), rng.choice([1, 3])
    lengths = [local] * world
    if rng.random() < 0.3:  # an uneven shard (sometimes an empty one)
        lengths[rng.randrange(world)] = rng.choice([0, local + n // world, max(local - 1, 0)])
    differing = None
    if rng.random() < 0.3:
        differing = (rng.randrange(world), rng.choice(["inputs", "seed", "scheme"]))
    return dict(variant_name=variant_name, scheme=scheme, local=local, lengths=lengths, B=B, H=H,
                differing=differing, input_seed=rng.randrange(2 ** 31))


def fuzz_trial(rank, world, rng) -> dict:
    t = draw(rng, world)
    S = t["local"] * world  # the sequence of the ranks that hold the drawn length
    inputs = whole_inputs(t["variant_name"], S, t["B"], t["H"],
                          torch.Generator().manual_seed(t["input_seed"]))
    has_dropout = t["variant_name"] == "dropout"
    scheme, dropout_seed = t["scheme"], (7 if has_dropout else None)
    if t["differing"] is not None and t["differing"][0] == rank:
        what = t["differing"][1]
        if what == "inputs" and inputs:
            inputs = whole_inputs(t["variant_name"], S, t["B"], t["H"],
                                  torch.Generator().manual_seed(t["input_seed"] + 1))
        elif what == "seed":  # another seed, or a stray one where there is no dropout
            dropout_seed = 8 if has_dropout else 7
        elif what == "scheme":
            scheme = "contiguous" if scheme == "zigzag" else "zigzag"
    result = {}

    def run():
        kernel = attncc.compile(SPECS[t["variant_name"]])
        gen = torch.Generator().manual_seed(t["input_seed"] + 2)
        L = t["lengths"][rank]
        whole = [torch.randn(t["B"], t["H"], S, D, generator=gen) for _ in range(4)]
        # Every rank reaches the call: shards are cut with the drawn scheme, and a rank
        # with another length holds random tensors of that length (cutting the whole
        # sequence otherwise could fail before the call).
        sharding = cp.Sharding(t["scheme"], world, rank)
        local = [sharding.shard(x).requires_grad_() for x in whole[:3]] if L == t["local"] else [
            torch.randn(t["B"], t["H"], L, D).requires_grad_() for _ in range(3)]
        ins = {n: x.clone().requires_grad_() if kernel.variant.input(n).learnable else x
               for n, x in inputs.items()}
        out = cp.context_parallel_attention(kernel, *local, scheme=scheme,
                                            dropout_seed=dropout_seed, **ins)
        out.backward(sharding.shard(whole[3]))
        result.update(out=sharding.unshard(out.detach()), dq=sharding.unshard(local[0].grad),
                      dk=sharding.unshard(local[1].grad), dv=sharding.unshard(local[2].grad))
    status = outcome(run)
    return dict(trial=t, status=status, **(result if rank == 0 else {}))


def check_trial(trials_by_rank, world) -> list:
    """Failures of one fuzz trial: every rank refused, or every rank answered right."""
    t = trials_by_rank[0]["trial"]
    statuses = [tr["status"] for tr in trials_by_rank]
    kinds = {s[0] for s in statuses}
    if "error" in kinds:
        errors = [s[1] for s in statuses if s[0] == "error"]
        return [f"{t}: an exception that is no CallError: {errors}"]
    if len(kinds) > 1:
        return [f"{t}: refused on some ranks only: {statuses}"]
    agrees = set(t["lengths"]) == {t["local"]} and (
        t["differing"] is None or (t["differing"][1] == "inputs" and t["variant_name"] in
                                   ("causal", "dropout")))
    if not agrees:
        return [] if kinds == {"refused"} else [f"{t}: a disagreeing call was not refused"]
    if kinds != {"ok"}:
        return [f"{t}: an agreeing call was refused: {statuses[0][1]}"]
    return check_against_reference(trials_by_rank[0], world)


def check_against_reference(got, world) -> list:
    t = got["trial"]
    variant = attncc.parse(SPECS[t["variant_name"]])
    S = t["local"] * world
    inputs = whole_inputs(t["variant_name"], S, t["B"], t["H"],
                          torch.Generator().manual_seed(t["input_seed"]))
    gen = torch.Generator().manual_seed(t["input_seed"] + 2)
    q, k, v, do = (torch.randn(t["B"], t["H"], S, D, generator=gen) for _ in range(4))

    def run(dtype):
        qkv = [x.to(dtype).requires_grad_() for x in (q, k, v)]
        ins = {n: x.to(dtype) if x.is_floating_point() else x for n, x in inputs.items()}
        # (batch, heads, seq, dim), said: a short sequence with more heads than positions
        # fits both layouts, which a call without layout= refuses.
        seed = dict(dropout_seed=7) if variant.dropout else {}  # refused without dropout
        out = attncc.reference(variant, *qkv, **seed, layout="bhsd", **ins)
        return dict(zip(["out", "dq", "dk", "dv"],
                        [out, *torch.autograd.grad(out, qkv, do.to(dtype))]))
    ref, eager = run(torch.float64), run(torch.float32)
    scales = gradient_scales(q, k, ref["out"], do, scale_value(variant, D), 1)
    failures = []
    for name in ref:
        err = max_abs_error(got[name], ref[name])
        if not torch.isfinite(got[name]).all() or not within_tolerance(
                err, max_abs_error(eager[name], ref[name]), torch.float32, ref[name],
                scales.get(name, 1.0)):
            failures.append(f"{t}: {name} error {err:.3g}")
    return failures


# ------------------------------------------------------------------ the spawn
def spawn(world: int, tmp: str, fuzz_trials: int, fuzz_seed: int) -> list:
    for spec in SPECS.values():
        attncc.compile(spec)  # generate once, so the ranks load from the cache
    ctx = mp.spawn(run_scenarios, (world, os.path.join(tmp, "init"), tmp, fuzz_trials, fuzz_seed),
                   nprocs=world, join=False)
    deadline = time.monotonic() + HANG_LIMIT + 20 * fuzz_trials
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                pytest.fail(f"world {world}: the ranks hung (still running after "
                            f"{HANG_LIMIT + 20 * fuzz_trials} s)")
    except ProcessException:
        errors = [open(os.path.join(tmp, f)).read() for f in sorted(os.listdir(tmp))
                  if f.startswith("error-")]
        pytest.fail(f"world {world}: a rank failed:\n" + "\n".join(errors or ["(no traceback)"]))
    return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]


def check_scenarios(results, world) -> list:
    failures = []
    for name, _, pattern in SCENARIOS:
        for rank, r in enumerate(results):
            kind, message = r["outcomes"][name]
            if kind != "refused" or not re.search(pattern, message):
                failures.append(f"{name}, rank {rank}: {kind}: {message}")
    for rank, r in enumerate(results):
        if r["outcomes"]["agreed_after"] != ("ok", None):
            failures.append(f"rank {rank}: the call after the refusals: "
                            f"{r['outcomes']['agreed_after']}")
    return failures


def check_fuzz(results, world) -> list:
    failures = []
    for i in range(len(results[0]["trials"])):
        failures += check_trial([r["trials"][i] for r in results], world)
    return failures


def test_disagreeing_ranks_are_refused_on_every_rank(tmp_path):
    results = spawn(3, str(tmp_path), fuzz_trials=1, fuzz_seed=0)
    failures = check_scenarios(results, 3) + check_fuzz(results, 3)
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_fuzz_shard_lengths_and_per_rank_inputs(world, tmp_path):
    results = spawn(world, str(tmp_path), fuzz_trials=40, fuzz_seed=1000 * world)
    failures = check_scenarios(results, world) + check_fuzz(results, world)
    assert not failures, "\n".join(failures)


# ------------------------------------------------------------------ checksums
def test_checksums_tell_inputs_apart():
    """Every kind of difference the all-gather must see: a value, two values swapped,
    a sign bit, the dtype, the shape; and an input changed in place after its checksum
    was kept."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(37, generator=gen)
    swapped = base.clone()
    swapped[[4, 30]] = swapped[[30, 4]]
    changed = base.clone()
    changed[11] = torch.nextafter(changed[11], torch.tensor(math.inf))
    zero, negative_zero = torch.zeros(5), -torch.zeros(5)
    kinds = [base, swapped, changed, base.double(), base.reshape(1, 37), zero, negative_zero,
             torch.zeros(5, dtype=torch.bool), torch.ones(5, dtype=torch.bool),
             torch.arange(5, dtype=torch.int32), torch.arange(5, dtype=torch.int32).flip(0)]
    sums = [tuple(agreement._checksum(t).tolist()) for t in kinds]
    assert len(set(sums)) == len(sums)
    assert tuple(agreement._checksum(base.clone()).tolist()) == sums[0]  # values, not identity
    doc = torch.arange(64, dtype=torch.int32) // 10
    before = agreement._checksum_once(doc).clone()
    assert torch.equal(agreement._checksum_once(doc), before)
    doc[20] = 9  # in place: the kept checksum must not be reused
    assert not torch.equal(agreement._checksum_once(doc), before)
    assert torch.equal(agreement._checksum_once(doc), agreement._checksum(doc))
    with torch.inference_mode():  # no version counter (it crashed): summed every call
        doc = torch.arange(64, dtype=torch.int32) // 10
        before = agreement._checksum_once(doc).clone()
        doc[20] = 9
        assert not torch.equal(agreement._checksum_once(doc), before)
