#!/usr/bin/env bash
# What --enable-deterministic-inference costs, flag on against off on the
# same machine in one run (issue 39): decode steps of `ebb bench one-batch`
# at each batch size, its prefill, and the nano-vllm workload (256
# requests, prompts and outputs of 100 to 1,024 tokens, temperature 1)
# through `ebb serve`. Run it on the GPU machine with ebb on PATH:
#
#   tools/det_cost.sh MODEL_DIR [OUT_DIR]
#
# BATCHES (default 1,64,256) and LOAD_FORMAT (dummy serves random weights
# from config.json alone, as tools/qwen3_06b.py --config-only writes) are
# read from the environment. JSON results go to OUT_DIR; the table is the
# last lines printed.
set -euo pipefail
model=${1:?usage: tools/det_cost.sh MODEL_DIR [OUT_DIR]}
out=${2:-${OUT:-/tmp/ebb-det-cost}}
batches=${BATCHES:-1,64,256}
load=()
[ -n "${LOAD_FORMAT:-}" ] && load=(--load-format "$LOAD_FORMAT")
mkdir -p "$out"

for mode in off on; do
	flag=()
	[ $mode = on ] && flag=(--enable-deterministic-inference)
	ebb bench one-batch --model "$model" "${load[@]}" "${flag[@]}" --batch-size "$batches" --input-len 128 \
		--output-len 128 --json >"$out/one-batch-$mode.json" 2>"$out/one-batch-$mode.log"
	ebb bench serving --model "$model" "${load[@]}" "${flag[@]}" --dataset random --num-prompts 256 \
		--temperature 1 --json >"$out/serving-$mode.json" 2>"$out/serving-$mode.log"
done

python3 - "$out" <<'PY'
import json, sys
d = sys.argv[1]
load = lambda name: json.load(open(f"{d}/{name}.json"))
rows = lambda r: r if isinstance(r, list) else [r]
off, on = ({x["batch_size"]: x for x in rows(load(f"one-batch-{m}"))} for m in ("off", "on"))
pct = lambda a, b: f"{100 * (b / a - 1):+.1f} %"
print("| | flag off | flag on | on against off |\n|---|---|---|---|")
for b in sorted(off):
    a, c = off[b]["decode_step_median_ms"], on[b]["decode_step_median_ms"]
    print(f"| batch {b}, decode ms a step | {a:.3f} | {c:.3f} | {pct(a, c)} |")
    a, c = off[b]["prefill_ms"], on[b]["prefill_ms"]
    print(f"| batch {b}, prefill ms | {a:.1f} | {c:.1f} | {pct(a, c)} |")
a, c = (load(f"serving-{m}")["output_tokens_per_s"] for m in ("off", "on"))
print(f"| nano-vllm workload, output tok/s | {a:,.0f} | {c:,.0f} | {pct(a, c)} |")
PY
