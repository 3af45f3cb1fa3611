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
# serialises. Prints, for each kernel and grid, its launches, total us,
# share of the sum, and a launch's median us, DRAM megabytes and throughput,
# largest first; the raw report is OUT_DIR/step.ncu-rep.
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
import csv, statistics, sys
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

# One row per kernel and grid: the layers' launches of one product share a
# row, and a kernel used for two products (gate_up and lm_head) gets two.
per = defaultdict(list)  # (name, grid) -> [(us, bytes)]
for r in data:
    if len(r) < len(names):
        continue
    key = (r[col["Kernel Name"]].split("(")[0], r[col["Grid Size"]].replace(" ", ""))
    per[key].append((value(r, "gpu__time_duration.sum"), value(r, "dram__bytes.sum")))
total = sum(us for v in per.values() for us, _ in v)
print(f"{len(data)} kernels, {total:,.1f} us in all")
print(f"{'kernel':40} {'grid':>14} {'launches':>8} {'us':>9} {'share':>6} {'median us':>9} {'MB':>8} {'GB/s':>6}")
for (name, grid), v in sorted(per.items(), key=lambda kv: -sum(us for us, _ in kv[1])):
    us, mb = sum(x for x, _ in v), statistics.median(b for _, b in v) / 1e6
    med = statistics.median(x for x, _ in v)
    print(f"{name[:40]:40} {grid:>14} {len(v):8d} {us:9.1f} {100 * us / total:5.1f}% {med:9.1f} {mb:8.2f} "
          f"{mb / med * 1e3 if med else 0:6.0f}")
PY
