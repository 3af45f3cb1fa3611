#!/usr/bin/env python3
"""Trainer weights into a tensor-parallel ebb on the GPU machine: a server
with --tp-size N on model A takes model B's weights from a trainer
(tools/weight_update_trainer.py) over CUDA IPC (one payload per rank, each
rank's copy on its GPU) and over NCCL (the trainer on GPU 0, ebb's ranks on
the next GPUs), and must then generate exactly as a fresh server on B.

    python3 tools/tp_weights_check.py --a /tmp/q06 --b /tmp/q06b --ebb ebb --tp 2 --out tpw.json
"""
import argparse
import json
import subprocess
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from tp_check import post, serve  # noqa: E402

PROMPTS = [[11, 22, 33, 44, 55, 66, 77], list(range(1000, 1100)), [5] * 40]


def greedy(url):
    return [post(url + "/generate", {"input_ids": p, "sampling_params": {"temperature": 0, "max_new_tokens": 32,
                                                                          "ignore_eos": True}})["output_ids"]
            for p in PROMPTS]


def run(ebb, a, b, tp, base, log, transport, fmt):
    p, url, _ = serve(ebb, a, tp, log, ["--base-gpu-id", str(base)])
    try:
        before = greedy(url)
        res = subprocess.run([sys.executable, "tools/weight_update_trainer.py", "--url", url, "--model", b,
                              "--transport", transport, "--format", fmt, "--tp-size", str(tp), "--bucket-mb", "512",
                              "--repeat", "3"], capture_output=True, text=True)
        if res.returncode != 0:
            return {"error": res.stdout[-2000:] + res.stderr[-2000:]}
        rep = json.loads(res.stdout.strip().splitlines()[-1])
        return {"before": before, "after": greedy(url), "median_ms": rep["median_ms"], "gb_per_s": rep["gb_per_s"]}
    finally:
        p.terminate()
        p.wait(60)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", required=True)
    ap.add_argument("--b", required=True)
    ap.add_argument("--ebb", default="ebb")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--paths", default="ipc,nccl")
    ap.add_argument("--out", default="tpw.json")
    ap.add_argument("--log", default="tpw_serve.log")
    args = ap.parse_args()
    report = {"tp": args.tp}
    with open(args.log, "a") as log:
        p, url, _ = serve(args.ebb, args.b, args.tp, log, ["--base-gpu-id", "1"])
        try:
            want = greedy(url)
        finally:
            p.terminate()
            p.wait(60)
        for name, transport, fmt, base in [("ipc", "ipc", "flattened", 0), ("nccl", "nccl", "flattened", 1)]:
            if name not in args.paths.split(","):
                continue
            r = run(args.ebb, args.a, args.b, args.tp, base, log, transport, fmt)
            if "after" in r:
                r["matches_fresh_server_on_b"] = r["after"] == want
                r["changed"] = r["before"] != want
                del r["before"], r["after"]
            report[name] = r
            print(name, json.dumps(r)[:1500], flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
