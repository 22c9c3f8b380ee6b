"""Cold start of a new variant (issue 17): seconds from a new process to the first
forward + backward result, each ANCHORS.md variant in a fresh process with empty attncc
and Triton caches, and what the configs it chose cost in steady calls.

    python benchmarks/compile_latency.py --mode full   # tune (what every first call did)
    python benchmarks/compile_latency.py --mode 1      # shipped winners (known_winners.json)
    python benchmarks/compile_latency.py --mode 1 --against $OUT/cold-full.json
    python benchmarks/compile_latency.py --mode 1 --tune-too --rows causal_8k,prefix_lm,window_2048
    python benchmarks/compile_latency.py --write-winners cold-full.json [--device cpu]

Each child process times its phases, ending each in a device synchronisation: import
torch, CUDA initialisation, import attncc, attncc.compile, the first forward, the first
backward; then the steady forward and forward + backward (median of do_bench) at the
configs it chose, and it reports those configs and the tuner's timings of every
candidate (its log lines). `--against` (a file of an earlier --mode full run) makes each
child also time the tuned configs of that run, alternating with its own in one process,
so the two compare on the same inputs and clocks. The table is printed last; the whole
results go to $OUT/cold-MODE.json.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

# (ANCHORS row, gpu_suite variant, sequence length, head dim)
ROWS = [("full", "full", 16384, 128), ("causal", "causal", 16384, 128),
        ("causal_gqa", "causal_gqa", 16384, 128), ("full_d64_4k", "full", 4096, 64),
        ("sliding_window", "sliding_window", 16384, 128), ("document", "document", 16384, 128),
        ("bigbird", "bigbird", 16384, 128), ("alibi", "alibi", 16384, 128),
        ("softcap", "softcap", 16384, 128)]
# Variants no shipped winner was measured on, each near a measured class (a length, a
# density and a mask away): --tune-too times their shipped configs against tuning's.
EXTRA_SPECS = {
    "prefix_lm": "attention prefix_lm { param prefix: int = 1024 mask q >= k or k < prefix }",
    "window_2048": ("attention window_2048 { param window: int = 2048 "
                    "mask q >= k and q - k < window }"),
}
EXTRA_ROWS = [("causal_8k", "causal", 8192, 128), ("prefix_lm", "prefix_lm", 16384, 128),
              ("window_2048", "window_2048", 16384, 128)]
ROWS_BY_NAME = {r[0]: r for r in ROWS + EXTRA_ROWS}


def child(row: str, against: dict | None, tune_too: bool = False) -> dict:
    clock = time.perf_counter
    phases = {}
    start = clock()
    import torch
    phases["import torch"] = clock() - start
    t = clock()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    phases["CUDA init"] = clock() - t

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("attncc.tuning").addHandler(Keep())
    logging.getLogger("attncc.tuning").setLevel(logging.INFO)
    t = clock()
    import attncc
    from attncc.runtime import tuning
    phases["import attncc"] = clock() - t
    from gpu_suite import VARIANTS, anchor_problem
    VARIANTS.update(EXTRA_SPECS)
    _, name, L, D = ROWS_BY_NAME[row]
    _, q, k, v, inputs = anchor_problem(name, L, D=D)
    torch.cuda.synchronize()
    t = clock()
    kernel = attncc.compile(VARIANTS[name])
    phases["attncc.compile"] = clock() - t
    t = clock()
    out = kernel(q, k, v, **inputs)
    torch.cuda.synchronize()
    phases["first forward"] = clock() - t
    do = torch.randn_like(out)
    t = clock()
    out.backward(do)
    torch.cuda.synchronize()
    phases["first backward"] = clock() - t
    first_result = sum(phases[p] for p in ("import attncc", "attncc.compile", "first forward",
                                           "first backward"))
    chosen = _chosen(tuning)

    import triton

    def fwd():
        kernel(q, k, v, **inputs)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        kernel(q, k, v, **inputs).backward(do)

    def time_with(choices: dict) -> dict:
        tuning._MEMORY.clear()
        tuning._MEMORY.update({(kernel.key, key): tuning.Choice.from_json(c, "run file")
                               for key, c in choices.items()})
        return {"fwd": triton.testing.do_bench(fwd, warmup=100, rep=400, return_mode="median"),
                "fwd+bwd": triton.testing.do_bench(fwd_bwd, warmup=100, rep=400,
                                                   return_mode="median")}

    steady = {"own": [], "against": []}
    theirs = (against or {}).get(row, {}).get("chosen")
    tune_s = None
    if tune_too:  # this process tunes the same calls, for the configs to compare with
        os.environ["ATTNCC_TUNE"] = "full"
        tuning._MEMORY.clear()
        t = clock()
        fwd_bwd()
        torch.cuda.synchronize()
        tune_s = clock() - t
        theirs = _chosen(tuning)
    for _ in range(3 if theirs else 1):  # alternate, so clock drift hits both alike
        steady["own"].append(time_with(chosen))
        if theirs:
            steady["against"].append(time_with(theirs))
    median = lambda runs, part: sorted(r[part] for r in runs)[len(runs) // 2] if runs else None
    return dict(row=row, phases=phases, first_result_s=first_result,
                import_to_result_s=sum(phases.values()), chosen=chosen, tuner_log=records,
                tuned=theirs, tune_s=tune_s,
                steady={w: {p: median(runs, p) for p in ("fwd", "fwd+bwd")}
                        for w, runs in steady.items() if runs})


def _chosen(tuning) -> dict:
    """The tuner's choices in this process: {tuning key: {"backend", "config"}}."""
    return {key[1]: choice.to_json() for key, choice in tuning._MEMORY.items()
            if isinstance(choice, tuning.Choice)}


def row_class(row: str, device: str) -> str:
    """The shipped winners' class of an ANCHORS row at its shape (known_winners.py)."""
    import attncc
    from attncc.runtime import known_winners, tuning
    from attncc.runtime.kernel import tile_density
    from attncc.arguments import Problem
    from gpu_suite import VARIANTS, anchor_problem
    VARIANTS.update(EXTRA_SPECS)
    _, name, L, D = ROWS_BY_NAME[row]
    _, q, k, v, inputs = anchor_problem(name, L, D=D, dev=device)
    kernel = attncc.compile(VARIANTS[name])
    p = Problem(batch=q.shape[0], heads_q=q.shape[1], heads_kv=k.shape[1], len_q=L, len_k=L,
                dim=D, dim_v=D)
    density = tile_density(kernel.module, p, inputs, device, kernel.variant.block or 64)
    return known_winners.variant_class(kernel.variant, kernel.module.USES_TABLES,
                                       tuning.density_bucket(density))


def write_winners(run_file: str, device: str):
    """Turn a --mode full run's tuned configs into known_winners.json entries for its GPU.
    Rows of one class must agree (they did: causal and GQA causal); if they do not, the
    entry is left out and the disagreement printed, so a class never gets a guess."""
    import re

    from attncc.runtime import known_winners
    run = json.load(open(run_file))
    entries, sources = {}, {}
    for r in run["rows"]:
        if "failed" in r:
            continue
        vclass = row_class(r["row"], device)
        for key, choice in r["chosen"].items():
            m = re.match(r"(.+)-d(\d+)-(\w+)-g\d+-q(\d+)-k(\d+)-on-([\w+]+)$", key)
            if not m:
                continue  # density-keyed entries are not shipped
            direction, dim, dtype, lq, lk, options = m.groups()
            entry = lambda what: known_winners.entry_key(what, int(dim), dtype, vclass, int(lq),
                                                         int(lk))
            # Its backend's config; and where backends competed, which one won.
            found = {entry(known_winners.config_entry(choice["backend"], direction)):
                     choice["config"]}
            if "+" in options:
                found[entry(known_winners.choice_entry(direction))] = choice["backend"]
            for name, winner in found.items():
                if name in entries and entries[name] != winner:
                    print(f"{name}: {sources[name]} chose {entries[name]}, {r['row']} {winner}; "
                          "left out")
                    entries[name] = None
                    continue
                entries.setdefault(name, winner)
                sources.setdefault(name, r["row"])
    data = json.loads(known_winners.WINNERS_FILE.read_text())
    data["winners"][run["gpu"]] = {k: w for k, w in sorted(entries.items()) if w is not None}
    known_winners.WINNERS_FILE.write_text(format_winners(data))
    print(f"{len(data['winners'][run['gpu']])} winners for {run['gpu']} "
          f"(triton {run['triton']}) written to {known_winners.WINNERS_FILE}")


def format_winners(data: dict) -> str:
    """known_winners.json with one line per entry, to read and diff."""
    lines = ["{", f' "about": {json.dumps(data["about"])},', ' "winners": {']
    gpus = list(data["winners"].items())
    for i, (gpu, entries) in enumerate(gpus):
        lines.append(f"  {json.dumps(gpu)}: {{")
        items = list(entries.items())
        for j, (key, winner) in enumerate(items):
            lines.append(f"   {json.dumps(key)}: {json.dumps(winner)}"
                         + ("," if j < len(items) - 1 else ""))
        lines.append("  }" + ("," if i < len(gpus) - 1 else ""))
    return "\n".join(lines + [" }", "}"]) + "\n"


def save(mode: str, rows: list, out_dir: str) -> str:
    import torch
    import triton
    path = os.path.join(out_dir, f"cold-{mode}.json")
    json.dump(dict(mode=mode, gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=triton.__version__, rows=rows), open(path, "w"), indent=1)
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="1", help="ATTNCC_TUNE for the children: full or 1")
    parser.add_argument("--rows", default=",".join(r for r, *_ in ROWS))
    parser.add_argument("--against", help="an earlier run's JSON: time its configs too")
    parser.add_argument("--tune-too", action="store_true",
                        help="each child also tunes (ATTNCC_TUNE=full) and times both")
    parser.add_argument("--write-winners", metavar="RUN_JSON",
                        help="write a --mode full run's winners into known_winners.json")
    parser.add_argument("--device", default="cuda", help="for --write-winners' tile densities")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write_winners:
        write_winners(args.write_winners, args.device)
        return
    if args.child:
        against = json.load(open(args.against)) if args.against else None
        result = child(args.child, {r["row"]: r for r in against["rows"]} if against else None,
                       args.tune_too)
        json.dump(result, open(args.result, "w"))
        return
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for row in args.rows.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, ATTNCC_TUNE=args.mode,
                       ATTNCC_CACHE_DIR=os.path.join(tmp, "attncc"),
                       TRITON_CACHE_DIR=os.path.join(tmp, "triton"))
            result_file = os.path.join(tmp, "result.json")
            cmd = [sys.executable, __file__, "--child", row, "--result", result_file]
            if args.against:
                cmd += ["--against", args.against]
            if args.tune_too:
                cmd += ["--tune-too"]
            t = time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            wall = time.perf_counter() - t
            if proc.returncode != 0:
                print(f"{row}: FAILED\n{proc.stderr[-3000:]}", flush=True)
                rows.append(dict(row=row, failed=proc.stderr[-3000:]))
                continue
            result = json.load(open(result_file))
            result["process_wall_s"] = wall
            rows.append(result)
            print(f"{row}: first result {result['first_result_s']:.1f} s "
                  f"(process {wall:.1f} s)", flush=True)
            save(args.mode + ("-tune-too" if args.tune_too else ""), rows, out_dir)  # after each row: a run cut short keeps its rows
    path = save(args.mode + ("-tune-too" if args.tune_too else ""), rows, out_dir)
    import torch
    import triton
    print(f"\nATTNCC_TUNE={args.mode} on {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}; seconds and ms; full results in {path}")
    print(f"{'variant':16s} {'import+compile+1st fwd+bwd':>27s} {'fwd ms':>8s} {'fwd+bwd ms':>10s}"
          + (f" {'tuned/own fwd':>13s} {'tuned/own f+b':>13s}" if args.against or args.tune_too
             else ""))
    for r in rows:
        if "failed" in r:
            print(f"{r['row']:16s} FAILED")
            continue
        own = r["steady"]["own"]
        line = f"{r['row']:16s} {r['first_result_s']:27.1f} {own['fwd']:8.3f} {own['fwd+bwd']:10.3f}"
        if "against" in r["steady"]:
            them = r["steady"]["against"]
            line += f" {them['fwd'] / own['fwd']:13.3f} {them['fwd+bwd'] / own['fwd+bwd']:13.3f}"
        print(line)


if __name__ == "__main__":
    main()
