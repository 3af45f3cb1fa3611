#!/usr/bin/env bash
# Issue 38's figures for the Qwen3-30B-A3B shape on one GPU machine, in one
# command from the repository root (build and carry the binaries as for
# tools/gpu_check.sh):
#
#   source .device/dist/env.sh; tools/moe_check.sh [OUT_DIR] [STEP ...]
#
# Steps (all when none is named; a device command runs at most 10 minutes,
# so name a few at a time):
#   experts   `ebb bench moe`: the experts alone under uniform routing
#   decode    decode steps at batch 1 and 256 beside the compiled PyTorch
#             decoder (tools/torch_decoder.py; compiling takes minutes)
#   replay    batch 256 (sampled) with and without --enable-return-routed-experts
#   serving   nano-vllm's workload through `ebb serve`
#   sync      the 61 GB weight sync over CUDA IPC from the trainer stand-in
#             (it holds a second copy: an H200)
#   cycle     the 4-layer copy with weights checked against transformers,
#             then 20 RL cycles on it
# The full shape runs from config.json alone (--load-format dummy). Logs go
# to OUT_DIR; the summary is the last lines printed.
set -uo pipefail
out=${1:-${OUT:-/tmp/ebb-moe-check}}
shift || true
steps=${*:-experts decode replay serving sync cycle}
mkdir -p "$out"
root=$(cd "$(dirname "$0")/.." && pwd)
full=${MODEL:-/tmp/qwen3-30b-a3b}
short=${SHORT_MODEL:-/tmp/qwen3-30b-a3b-l4}
summary=()
status=0

run() { # run NAME PATTERN COMMAND...: logs to $out/NAME.log; the summary quotes lines matching PATTERN
	local name=$1 pattern=$2 t0=$SECONDS
	shift 2
	if "$@" >"$out/$name.log" 2>&1; then
		summary+=("PASS $name ($((SECONDS - t0)) s)")
	else
		summary+=("FAIL $name ($((SECONDS - t0)) s): $(tail -n 3 "$out/$name.log" | tr '\n' ' ')")
		status=1
	fi
	[ -n "$pattern" ] && summary+=("$(grep -hE "$pattern" "$out/$name.log" | sed 's/^/    /')")
}

wants() { [[ " $steps " == *" $1 "* ]]; }

[ -f "$full/config.json" ] || python3 "$root/tools/qwen3_moe.py" --dir "$full" --config-only >"$out/config.log" 2>&1
dummy=(--model "$full" --load-format dummy)

wants experts && run experts 'moe_|tokens' ebb bench moe --tokens 1,8,16,64,256,1024,8192
wants decode && run decode '^\|' python3 "$root/tools/torch_decoder.py" --model "$full" --batch-size 1,256 \
	--output-len 64 --ebb ebb --out "$out/decode.json"
if wants replay; then
	# sampled, so that the rows route apart as a trained model's do
	run replay-off '^ +256 ' ebb bench one-batch "${dummy[@]}" --batch-size 256 --input-len 128 --output-len 64 \
		--temperature 1
	run replay-on '^ +256 ' ebb bench one-batch "${dummy[@]}" --batch-size 256 --input-len 128 --output-len 64 \
		--temperature 1 --enable-return-routed-experts
fi
wants serving && run serving '^throughput|^bandwidth floor|failed' ebb bench serving "${dummy[@]}" --dataset random \
	--num-prompts 256 --temperature 1
# The trainer stand-in holds its own 61 GB copy on the same GPU: the server
# keeps under half of it.
wants sync && run sync 'path|^ +[0-9]+ |weights read back|GB/s' ebb bench weight-sync "${dummy[@]}" --path ipc \
	--bucket-mb 512 --repeat 3 --mem-fraction-static 0.47
if wants cycle; then
	run short-model '"(mean_abs_logprob_diff|transformers_eager_vs_sdpa_mean|routing_checked|routing_equal|pass)"' python3 "$root/tools/qwen3_moe.py" --dir "$short" --layers 4 --ebb ebb \
		--out "$out/short-model.json"
	run cycle 'bare context|residual|drift|probe' ebb bench rl-cycle --model "$short" --cycles 20 --batch-size 64
fi

echo "== MoE check ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)), logs in $out"
printf '%s\n' "${summary[@]}"
[ $status -eq 0 ] && echo "MoE check: PASS" || echo "MoE check: FAIL"
exit $status
