#!/usr/bin/env bash
# ab.sh: an A/B run of `ebb bench one-batch`. Each setting (environment
# assignments such as EBB_MOE_GLU_BLOCKS=3 or
# EBB_KERNEL_DEFINES=MOE_SORT_CACHE=1, several separated by spaces in one
# argument, or - for none) runs in turn, the settings interleaved over the
# rounds, so that every ratio is taken on one machine within the same
# minutes (machines differ by up to 1 %, more than most changes measured).
# It prints each run's decode ms a step, then per setting and batch size the
# rounds, their mean against the first setting's and whether the outputs
# were the same tokens (the output digest). Exit status 1 if a run failed.
# On a GPU machine the settings' kernels are first compiled side by side
# (`ebb kernels --cache`), so that no run waits for its own compile.
#
#   tools/ab.sh [-r ROUNDS] [-o OUT_DIR] SETTING... -- ONE-BATCH-ARGS
#   tools/ab.sh -r 2 - EBB_MOE_GLU_BLOCKS=3 -- --model /tmp/q30 \
#       --load-format dummy --batch-size 1,256 --input-len 128 --output-len 128 --temperature 1
#
# EBB (default: ebb on the PATH) names the binary; a setting's own EBB=PATH
# runs that binary instead, so that two builds compare on one machine. The
# runs' JSON and logs are left in OUT_DIR (default: a temporary directory).
set -euo pipefail
rounds=2 out=""
while getopts "r:o:" opt; do
	case $opt in
	r) rounds=$OPTARG ;;
	o) out=$OPTARG ;;
	*) exit 2 ;;
	esac
done
shift $((OPTIND - 1))
settings=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
	settings+=("$1")
	shift
done
if [ $# -eq 0 ] || [ ${#settings[@]} -eq 0 ]; then
	sed -n '2,/^set /p' "$0" | grep '^#' | sed 's/^# \{0,1\}//' >&2
	exit 2
fi
shift # the --
ebb=${EBB:-ebb}
out=${out:-$(mktemp -d)}
mkdir -p "$out"
failed=0

# setting I: env_args and bin for setting I.
setting() {
	env_args=()
	[ "${settings[$1]}" != "-" ] && read -r -a env_args <<<"${settings[$1]}"
	bin=$ebb
	for a in ${env_args[@]+"${env_args[@]}"}; do
		if [[ $a == EBB=* ]]; then bin=${a#EBB=}; fi
	done
}

# Each setting's kernels (EBB_KERNEL_DEFINES, EBB_KERNEL_DIR) compiled side
# by side into the cache the runs load from, rather than by each first run
# in turn (about a minute each on the H200's NVRTC); a failure here is left
# for the run to report.
if cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1) && [ -n "$cc" ]; then
	for i in "${!settings[@]}"; do
		setting "$i"
		env ${env_args[@]+"${env_args[@]}"} "$bin" kernels --cache --arch "sm_${cc/./}" >"$out/kernels-s$i.log" 2>&1 &
	done
	wait
fi

for r in $(seq 1 "$rounds"); do
	for i in "${!settings[@]}"; do
		s=${settings[$i]}
		f="$out/s$i-r$r"
		setting "$i"
		if env ${env_args[@]+"${env_args[@]}"} "$bin" bench one-batch --json "$@" >"$f.json" 2>"$f.log"; then
			python3 -c 'import json,sys
for b in json.load(open(sys.argv[1])):
    print("round %s  %-40s batch %4d  %9.3f ms a step  %s" % (sys.argv[2], sys.argv[3], b["batch_size"], b["decode_step_median_ms"], b["output_digest"]))' \
				"$f.json" "$r" "$s"
		else
			echo "round $r  $s: failed (exit $?), log $f.log:" >&2
			tail -5 "$f.log" >&2
			failed=1
		fi
	done
done
python3 - "$out" "$rounds" "${settings[@]}" <<'EOF'
import json, os, sys
out, rounds, settings = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
runs = {}  # (setting, batch) -> [(ms, digest)]
for i in range(len(settings)):
    for r in range(1, rounds + 1):
        f = os.path.join(out, "s%d-r%d.json" % (i, r))
        if os.path.getsize(f) == 0:
            continue
        for b in json.load(open(f)):
            runs.setdefault((i, b["batch_size"]), []).append((b["decode_step_median_ms"], b["output_digest"]))
print("\n| setting | batch | ms a decode step, by round | mean | against the first | same tokens |")
print("|---|---|---|---|---|---|")
for batch in sorted({b for _, b in runs}):
    base = runs.get((0, batch))
    for i, s in enumerate(settings):
        got = runs.get((i, batch))
        if not got:
            print("| %s | %d | failed | | | |" % (s, batch))
            continue
        mean = sum(ms for ms, _ in got) / len(got)
        vs, same = "", ""
        if base:
            bmean = sum(ms for ms, _ in base) / len(base)
            vs = "%+.2f %%" % (100 * (mean / bmean - 1))
            same = "yes" if {d for _, d in got} == {d for _, d in base} else "no"
        print("| %s | %d | %s | %.3f | %s | %s |" % (s, batch, ", ".join("%.3f" % ms for ms, _ in got), mean, vs, same))
print("\nruns in %s" % out)
EOF
exit $failed
