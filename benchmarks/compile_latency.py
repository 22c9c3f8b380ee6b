"""Cold start of a new variant (issue 17): seconds from a new process to the first
forward + backward result, each ANCHORS.md variant in a fresh process with empty attncc
and Triton caches, and what the configs it chose cost in steady calls.

    python benchmarks/compile_latency.py --mode full   # tune (what every first call did)
    python benchmarks/compile_latency.py --mode 1      # shipped winners (known_winners.json)
    python benchmarks/compile_latency.py --mode 1 --against $OUT/cold-full.json

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


def child(row: str, against: dict | None) -> dict:
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
    name, L, D = next((n, L, D) for r, n, L, D in ROWS if r == row)
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
    chosen = {key: config for (_, key), config in tuning._MEMORY.items()}

    import triton

    def fwd():
        kernel(q, k, v, **inputs)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        kernel(q, k, v, **inputs).backward(do)

    def time_with(configs: dict) -> dict:
        tuning._MEMORY.clear()
        tuning._MEMORY.update({(kernel.key, key): c for key, c in configs.items()})
        return {"fwd": triton.testing.do_bench(fwd, warmup=100, rep=400, return_mode="median"),
                "fwd+bwd": triton.testing.do_bench(fwd_bwd, warmup=100, rep=400,
                                                   return_mode="median")}

    steady = {"own": [], "against": []}
    theirs = (against or {}).get(row, {}).get("chosen")
    for _ in range(3 if theirs else 1):  # alternate, so clock drift hits both alike
        steady["own"].append(time_with(chosen))
        if theirs:
            steady["against"].append(time_with(theirs))
    median = lambda runs, part: sorted(r[part] for r in runs)[len(runs) // 2] if runs else None
    return dict(row=row, phases=phases, first_result_s=first_result,
                import_to_result_s=sum(phases.values()), chosen=chosen, tuner_log=records,
                steady={w: {p: median(runs, p) for p in ("fwd", "fwd+bwd")}
                        for w, runs in steady.items() if runs})


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
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        against = json.load(open(args.against)) if args.against else None
        result = child(args.child, {r["row"]: r for r in against["rows"]} if against else None)
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
            save(args.mode, rows, out_dir)  # after each row: a run cut short keeps its rows
    path = save(args.mode, rows, out_dir)
    import torch
    import triton
    print(f"\nATTNCC_TUNE={args.mode} on {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {triton.__version__}; seconds and ms; full results in {path}")
    print(f"{'variant':16s} {'import+compile+1st fwd+bwd':>27s} {'fwd ms':>8s} {'fwd+bwd ms':>10s}"
          + (f" {'vs tuned fwd':>12s} {'vs tuned f+b':>12s}" if args.against else ""))
    for r in rows:
        if "failed" in r:
            print(f"{r['row']:16s} FAILED")
            continue
        own = r["steady"]["own"]
        line = f"{r['row']:16s} {r['first_result_s']:27.1f} {own['fwd']:8.3f} {own['fwd+bwd']:10.3f}"
        if "against" in r["steady"]:
            them = r["steady"]["against"]
            line += f" {them['fwd'] / own['fwd']:12.3f} {them['fwd+bwd'] / own['fwd+bwd']:12.3f}"
        print(line)


if __name__ == "__main__":
    main()
