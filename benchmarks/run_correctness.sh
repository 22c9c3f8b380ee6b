#!/usr/bin/env bash
# Correctness on the GPU, compiled in parallel: one process per group of variants
# (Triton compiles on the CPU; the machine has 16 cores), then one merged report.
set -u
groups=("full,causal" "causal_gqa,sliding_window" "document,bigbird" "alibi,softcap"
        "bottom_right,prefix_lm" "sinks_window,chunked" "dropout,rel_bias" "empty_rows"
        "gpt_oss_sinks,sink_empty_rows" "sigmoid,relu" "sum_relu")
# Correctness, not speed: the first candidate config, no tuning (tuning compiles many).
export ATTNCC_TUNE=0
mkdir -p /tmp/corr
for i in "${!groups[@]}"; do
  python3 benchmarks/gpu_suite.py --part correctness --variants "${groups[$i]}" \
      --results /tmp/corr/$i.json > /tmp/corr/$i.log 2>&1 &
done
wait
cat /tmp/corr/*.log | grep -v "^torch " | grep -v "^correctness:" | sort
python3 - <<'PY'
import glob, json, os
rows = [r for f in sorted(glob.glob("/tmp/corr/*.json")) for r in json.load(open(f))]
out = os.environ.get("OUT", "out")
json.dump(rows, open(os.path.join(out, "correctness.json"), "w"), indent=1)
bad = [r for r in rows if not all(x["ok"] for x in r["rows"])]
print(f"\ncorrectness: {len(rows) - len(bad)} of {len(rows)} cases within 2x eager error + 2 eps x scale")
PY
grep -l Traceback /tmp/corr/*.log | head -3 | xargs -r tail -20
