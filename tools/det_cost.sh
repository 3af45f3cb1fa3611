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
# read from the environment. With ROUNDS=2 (or more) the runs alternate,
# off then on, on then off, ..., and the table gives each mode's mean, so
# that a GPU warming up over the run favours neither. JSON results go to
# OUT_DIR; the table is the last lines printed.
set -euo pipefail
model=${1:?usage: tools/det_cost.sh MODEL_DIR [OUT_DIR]}
out=${2:-${OUT:-/tmp/ebb-det-cost}}
batches=${BATCHES:-1,64,256}
load=()
[ -n "${LOAD_FORMAT:-}" ] && load=(--load-format "$LOAD_FORMAT")
mkdir -p "$out"

rounds=${ROUNDS:-1}
for ((r = 0; r < rounds; r++)); do
	modes="off on"
	((r % 2)) && modes="on off"
	for mode in $modes; do
		flag=()
		[ $mode = on ] && flag=(--enable-deterministic-inference)
		ebb bench one-batch --model "$model" "${load[@]}" "${flag[@]}" --batch-size "$batches" --input-len 128 \
			--output-len 128 --json >"$out/one-batch-$mode-$r.json" 2>"$out/one-batch-$mode-$r.log"
		ebb bench serving --model "$model" "${load[@]}" "${flag[@]}" --dataset random --num-prompts 256 \
			--temperature 1 --json >"$out/serving-$mode-$r.json" 2>"$out/serving-$mode-$r.log"
	done
done

python3 - "$out" "$rounds" <<'PY'
import json, statistics, sys
d, rounds = sys.argv[1], int(sys.argv[2])
load = lambda name: json.load(open(f"{d}/{name}.json"))
rows = lambda r: r if isinstance(r, list) else [r]
batch = {m: [{x["batch_size"]: x for x in rows(load(f"one-batch-{m}-{r}"))} for r in range(rounds)] for m in ("off", "on")}
mean = lambda m, b, key: statistics.mean(run[b][key] for run in batch[m])
pct = lambda a, b: f"{100 * (b / a - 1):+.1f} %"
each = lambda vals, f: " / ".join(f.format(v) for v in vals) if len(vals) > 1 else ""
print(f"rounds: {rounds}" + (" (off, on; then on, off; ...): means" if rounds > 1 else ""))
print("| | flag off | flag on | on against off |\n|---|---|---|---|")
for b in sorted(batch["off"][0]):
    for key, what, f in (("decode_step_median_ms", "decode ms a step", "{:.3f}"), ("prefill_ms", "prefill ms", "{:.1f}")):
        a, c = mean("off", b, key), mean("on", b, key)
        print(f"| batch {b}, {what} | {f.format(a)} | {f.format(c)} | {pct(a, c)} |")
tok = {m: [load(f"serving-{m}-{r}")["output_tokens_per_s"] for r in range(rounds)] for m in ("off", "on")}
a, c = statistics.mean(tok["off"]), statistics.mean(tok["on"])
print(f"| nano-vllm workload, output tok/s | {a:,.0f} | {c:,.0f} | {pct(a, c)} |")
if rounds > 1:
    for m in ("off", "on"):
        print(f"{m}, each round: " + "; ".join(
            f"b{b} " + each([run[b]["decode_step_median_ms"] for run in batch[m]], "{:.3f}") for b in sorted(batch[m][0]))
            + "; nano " + each(tok[m], "{:,.0f}"))
PY
