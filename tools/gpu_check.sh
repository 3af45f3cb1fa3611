#!/usr/bin/env bash
# The GPU check: what CI cannot see, in one command on a GPU machine. Run it
# before resolving anything that touches cuda/, runner/, model/ or
# scheduler/. It takes about nine minutes on an H100, more with its chaos step
# (split it over calls with SKIP), and fails (exit 1) on
# any failed test or request, KV still held when idle, a broken invariant,
# or GPU memory that grows.
#
# Build here (Go is not on the GPU machine) and carry the binaries:
#
#   go build -o .device/bin/ebb ./cmd/ebb
#   (cd cuda && go test -c -o ../.device/bin/cuda.test) && (cd engine && go test -c -o ../.device/bin/engine.test)
#   ../shared/tools/device-bundle .device/dist .device/bin/*     # adds libzmq
#
# then on the GPU machine, from the repository root:
#
#   source .device/dist/env.sh; tools/gpu_check.sh [OUT_DIR]
#
# Steps: the CUDA kernel tests against the CPU reference; the goldens on
# CUDA; a Qwen3-0.6B-shaped model (tools/qwen3_06b.py) served with a KV
# cache of 200k tokens, then through it prompts of 1 to 40,000 tokens, a
# 2,000-token prompt's top logprobs (input_top_logprobs), KV demand 1.6x the cache from rollouts that may stop early (so some are
# retracted), and a soak of GRPO-shaped rollouts (groups of 8, log-normal
# lengths, the model's own top_k/top_p) for SOAK seconds, and one for CHAOS
# seconds while `bench serving --chaos` pauses (every mode), releases and
# resumes every tag (the server keeps a CPU backup of its weights), flushes,
# updates the weights from disk (waiting for the running requests)
# and probes /health_generate, each checked; then the same
# model served with --enable-deterministic-inference and checked by
# tools/det_check.py --quick. Every serving
# step runs `ebb bench serving --check`. Logs go to OUT_DIR; the summary
# is the last lines printed.
#
# EBB_KERNEL_DEFINES or EBB_KERNEL_DIR in the environment reach every step
# (the check of an A/B setting before it becomes the default); the summary
# names them.
#
# SKIP="kernels goldens" leaves those steps out (say where they passed on
# the same build): the summary names them and the verdict says so.
set -uo pipefail
out=${1:-${OUT:-/tmp/ebb-gpu-check}}
mkdir -p "$out"
model=${MODEL:-/tmp/qwen3-0.6b}
soak=${SOAK:-60}
chaos=${CHAOS:-30}
port=${PORT:-30111}
root=$(cd "$(dirname "$0")/.." && pwd)
bin=$(dirname "$(command -v ebb)")
summary=()
status=0
skip=${SKIP:-}
skipped=()

# The test binaries the steps not skipped run, next to ebb: a bundle that
# left one out fails here, not after minutes of the steps before it.
for need in "kernels cuda.test" "goldens engine.test"; do
	read -r name file <<<"$need"
	if [[ " $skip " != *" $name "* && ! -x "$bin/$file" ]]; then
		echo "GPU check: no $bin/$file for the $name step (build it with go test -c, or SKIP=\"$name\")" >&2
		exit 2
	fi
done

# step NAME COMMAND...: runs it, logs to $out/NAME.log, records the outcome
# and prints it at once, so that a run cut short (a timeout) still says
# which steps passed.
step() {
	local name=$1 t0=$SECONDS
	shift
	if [[ " $skip " == *" $name "* ]]; then
		skipped+=("$name")
		summary+=("SKIP $name")
		echo "step: ${summary[-1]}"
		return
	fi
	if "$@" >"$out/$name.log" 2>&1 && ran "$name"; then
		summary+=("PASS $name ($((SECONDS - t0)) s)$(note "$name")")
	else
		summary+=("FAIL $name ($((SECONDS - t0)) s): $(tail -n 3 "$out/$name.log" | tr '\n' ' ')")
		status=1
	fi
	echo "step: ${summary[-1]}"
}

# ran says whether a test step ran any test: a test binary that exits 0
# having run none (a stub, a -test.run that matches nothing) is no pass.
ran() {
	case $1 in
	kernels | goldens) grep -qE '^--- PASS' "$out/$1.log" || { echo "no test passed" >>"$out/$1.log"; return 1; } ;;
	esac
}

# note picks the figure worth quoting from a step's log.
note() {
	case $1 in
	serving-*) grep -hE '^throughput|^bandwidth floor|retracted|^chaos:|^checks|radix cache' "$out/$1.log" |
		sed 's/, so their prefill was skipped.*//; s/^/  /' | tr '\n' ';' | sed 's/^/: /' ;;
	kernels | goldens) grep -cE '^--- PASS' "$out/$1.log" | sed 's/^/: /; s/$/ tests passed/' ;;
	deterministic) grep -hE '^decode vs prefill' "$out/$1.log" | sed 's/^/: /' ;;
	input-top) tail -n 1 "$out/$1.log" | sed 's/^/: /' ;;
	esac
}

bench() { # bench NAME ARGS...: one `ebb bench serving --check` run against the server
	local name=$1
	shift
	step "serving-$name" ebb bench serving --url "http://127.0.0.1:$port" --model "$model" --check "$@"
}

step kernels "$bin/cuda.test" -test.v -test.count=1
step goldens bash -c "cd '$root/engine' && '$bin/engine.test' -test.v -test.count=1 -test.run CUDA"
step model python3 "$root/tools/qwen3_06b.py" --dir "$model" --ebb ebb --make-only

# serve LOG FLAGS...: starts the check's server (a KV cache of 200k
# tokens) with FLAGS, logging to $out/LOG, and waits for /health.
serve() {
	local log=$1
	shift
	ebb serve --model "$model" --port "$port" --max-total-tokens 200000 "$@" >"$out/$log" 2>&1 &
	server=$!
	for _ in $(seq 300); do
		curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0
		kill -0 $server 2>/dev/null || return 1
		sleep 1
	done
	return 1
}
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null' EXIT

if ! serve serve.log --log-level info --enable-weights-cpu-backup; then
	summary+=("FAIL serve: the server did not start: $(tail -n 3 "$out/serve.log" | tr '\n' ' ')")
	status=1
else
	curl -s "http://127.0.0.1:$port/memory_stats" >"$out/memory-start.json"
	for len in 1 8191 8193 16384 32000 40000; do
		bench "prompt-$len" --dataset fixed --input-len "$len" --output-len 64 --num-prompts 2 --temperature 1
	done
	# The prompt's top logprobs (input_top_logprobs) over 2,000 positions:
	# more rows than one sampling call takes, each list in order and holding
	# the prompt token's own logprob where the token is among them.
	step input-top python3 - "http://127.0.0.1:$port" <<'PY'
import json, random, sys, urllib.request
random.seed(7)
ids = [random.randrange(1000, 20000) for _ in range(2000)]
body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 5,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
req = urllib.request.Request(sys.argv[1] + "/generate", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
meta = json.loads(urllib.request.urlopen(req, timeout=600).read())["meta_info"]
inp, top = meta["input_token_logprobs"], meta["input_top_logprobs"]
assert len(inp) == len(ids) and len(top) == len(ids) and top[0] is None, (len(inp), len(top))
bad = 0
for pos in range(1, len(ids)):
    lps = [e[0] for e in top[pos]]
    own = {e[1]: e[0] for e in top[pos]}.get(ids[pos])
    if len(lps) != 5 or lps != sorted(lps, reverse=True) or lps[0] < inp[pos][0] or (own is not None and own != inp[pos][0]):
        bad += 1
print(f"{len(ids) - 1} positions, {bad} out of order or off the token's own logprob")
sys.exit(1 if bad else 0)
PY
	# 70 x (512 + 4096) tokens = 1.6x the cache; may stop at EOS, so the
	# scheduler expects less than all of it and must retract.
	bench pressure --dataset fixed --input-len 512 --output-len 4096 --num-prompts 70 --temperature 1 \
		--ignore-eos=false
	bench grpo-soak --dataset random --min-input-len 256 --max-input-len 1024 --output-dist lognormal \
		--min-output-len 512 --max-output-len 4096 --group-size 8 --num-prompts 16 --temperature 1 \
		--duration "${soak}s"
	bench chaos --dataset random --min-input-len 128 --max-input-len 1024 --output-dist lognormal \
		--min-output-len 256 --max-output-len 2048 --group-size 4 --num-prompts 16 --temperature 1 \
		--duration "${chaos}s" --chaos 500ms --chaos-pause-modes retract,in_place,abort
	curl -s "http://127.0.0.1:$port/memory_stats" >"$out/memory-end.json"
	step memory python3 - "$out/memory-start.json" "$out/memory-end.json" <<'PY'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
grown = b["nvml_process_bytes"] - a["nvml_process_bytes"]
reserved = lambda s: sum(t["reserved_bytes"] for t in s["tags"])
print(f"process {a['nvml_process_bytes'] >> 20} -> {b['nvml_process_bytes'] >> 20} MiB, regions {reserved(a) >> 20} -> {reserved(b) >> 20} MiB")
# Less is no leak: the chaos's last torch_empty_cache, or a release of every
# tag, may leave the workspace empty where no later step needed it.
sys.exit(1 if grown > 32 << 20 or reserved(b) > reserved(a) else 0)
PY
	[[ " $skip " == *" memory "* ]] || summary[-1]+=": $(tail -n 1 "$out/memory.log")"
	if grep -q "invariant violated" "$out/serve.log"; then
		summary+=("FAIL invariants: $(grep -m1 'invariant violated' "$out/serve.log")")
		status=1
	fi
fi
kill $server 2>/dev/null
wait $server 2>/dev/null

# Deterministic inference through a server of its own: a request's tokens
# and logprobs alone and among others, cached, and decode against prefill
# (tools/det_check.py --quick).
if serve serve-deterministic.log --enable-deterministic-inference; then
	step deterministic python3 "$root/tools/det_check.py" --url "http://127.0.0.1:$port" --quick
else
	summary+=("FAIL deterministic: the server did not start: $(tail -n 3 "$out/serve-deterministic.log" | tr '\n' ' ')")
	status=1
fi

echo "== GPU check ($(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)), logs in $out"
# A check run under an A/B setting checks that setting's kernels, not the
# defaults: the summary says so.
for v in EBB_KERNEL_DEFINES EBB_KERNEL_DIR; do
	[ -n "${!v:-}" ] && echo "   with $v=${!v}"
done
printf '%s\n' "${summary[@]}"
verdict=PASS
[ $status -eq 0 ] || verdict=FAIL
if [ ${#skipped[@]} -gt 0 ]; then
	echo "GPU check: $verdict (steps left out: ${skipped[*]})"
else
	echo "GPU check: $verdict"
fi
exit $status
