#!/usr/bin/env bash
# Where one step of `ebb bench one-batch` goes, kernel by kernel, under
# Nsight Compute, on the GPU machine (ebb and ncu on PATH):
#
#   tools/step_profile.sh OUT_DIR STEP [one-batch flags ...]
#   tools/step_profile.sh $OUT/prof 8 --model /tmp/q30 --load-format dummy \
#       --batch-size 256 --input-len 128 --output-len 12 --temperature 1
#
# STEP counts the engine's steps from 0: the prefill chunks come first (256 x
# 128 tokens are 4 chunks of 8,192), then one decode step each, so give an
# --output-len past it. The first batch size is profiled. Kernels inside
# CUDA graphs are profiled one by one (--graph-profiling node), at the
# GPU's own clocks and with its caches left warm, so each kernel's time is
# close to what it takes in the step; their sum is more than the step's,
# which overlaps launches (programmatic dependent launch) that ncu
# serialises. Prints, for each kernel name, its launches, total us, share
# of the sum and DRAM throughput, largest first; the raw report is
# OUT_DIR/step.ncu-rep.
set -euo pipefail
out=${1:?usage: tools/step_profile.sh OUT_DIR STEP [one-batch flags ...]}
step=${2:?usage: tools/step_profile.sh OUT_DIR STEP [one-batch flags ...]}
shift 2
mkdir -p "$out"
rm -f "$out/step.ncu-rep"
ncu --profile-from-start off --graph-profiling node --clock-control none --cache-control none \
	--metrics gpu__time_duration.sum,dram__bytes.sum -o "$out/step" \
	ebb bench one-batch "$@" --profile-step "$step" >"$out/ncu.log" 2>&1 || {
	tail -n 20 "$out/ncu.log"
	exit 1
}
ncu --import "$out/step.ncu-rep" --csv --page raw >"$out/step.csv"
python3 - "$out/step.csv" <<'PY'
import csv, sys
from collections import defaultdict

rows = list(csv.reader(open(sys.argv[1])))
head = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
names, units, data = rows[head], rows[head + 1], rows[head + 2:]
col = {n: i for i, n in enumerate(names)}
# ncu names its units either way depending on its version.
scale = {"nsecond": 1e-3, "usecond": 1, "msecond": 1e3, "second": 1e6,
         "ns": 1e-3, "us": 1, "ms": 1e3, "s": 1e6,
         "byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}

def value(r, metric):
    i = col[metric]
    return float(r[i].replace(",", "")) * scale[units[i]]

per = defaultdict(lambda: [0, 0.0, 0.0])  # launches, us, bytes
for r in data:
    if len(r) < len(names):
        continue
    k = per[r[col["Kernel Name"]].split("(")[0]]
    k[0] += 1
    k[1] += value(r, "gpu__time_duration.sum")
    k[2] += value(r, "dram__bytes.sum")
total = sum(v[1] for v in per.values())
print(f"{len(data)} kernels, {total:,.1f} us in all")
print(f"{'kernel':48} {'launches':>8} {'us':>10} {'share':>7} {'GB/s':>7}")
for name, (n, us, b) in sorted(per.items(), key=lambda kv: -kv[1][1]):
    print(f"{name[:48]:48} {n:8d} {us:10.1f} {100 * us / total:6.1f}% {b / us / 1e3 if us else 0:7.0f}")
PY
