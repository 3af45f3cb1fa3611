#!/usr/bin/env python3
"""Tensor parallelism checked on the GPU machine: `ebb serve --tp-size N` for
each N against transformers (bf16) on a Qwen3-shaped random model, then the
speed of each. Run on a machine with max(N) GPUs:

    python3 tools/tp_check.py --shape 8b --dir /tmp/q8b --ebb ebb --tp 1,2 --out tp.json

1. Writes the model (tools/qwen3_06b.py's generator; 8b: 36 layers, hidden
   4096, 32 query / 8 KV heads, head_dim 128, intermediate 12288, vocab
   151936, untied lm_head).
2. transformers bf16 on GPU 0: teacher-forced logprobs of random prompts and
   greedy continuations with each step's top-1/top-2 gap.
3. For each N: `ebb serve --tp-size N`; the same prompts one at a time
   through /generate (prompt logprobs from position 0, greedy); then
   `ebb bench serving` at batch 1 (inter-token latency) and batch 256
   (throughput) against that server.
4. Reports, per N: mean |logprob difference| to transformers, greedy agreement
   with transformers and with N=1 (and transformers' top-2 gap where they part),
   batch-1 ITL, batch-256 output tokens/s.
"""
import argparse
import json
import random
import socket
import subprocess
import sys
import time
import urllib.request

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from qwen3_06b import SHAPES, make_model, reference  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body, timeout=600):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def serve(ebb, path, tp, log, extra=()):
    port = free_port()
    cmd = [ebb, "serve", "--model", path, "--tp-size", str(tp), "--port", str(port), "--zmq-endpoint", "none",
           "--skip-server-warmup", "--log-level", "info", "--context-length", "4096", *extra]
    p = subprocess.Popen(cmd, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while time.time() - t0 < 400:
        if p.poll() is not None:
            raise RuntimeError(f"ebb serve --tp-size {tp} exited with {p.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return p, url, time.time() - t0
        except OSError:
            pass
        time.sleep(0.5)
    p.kill()
    raise RuntimeError("ebb serve did not become healthy")


def bench(ebb, url, n, inp, out):
    res = subprocess.run([ebb, "bench", "serving", "--url", url, "--dataset", "fixed", "--num-prompts", str(n),
                          "--input-len", str(inp), "--output-len", str(out), "--json"],
                         check=True, capture_output=True, text=True)
    return json.loads(res.stdout)


def agree(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/q8b")
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--ebb", default="ebb")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--out", default="tp.json")
    ap.add_argument("--log", default="tp_serve.log")
    args = ap.parse_args()
    t0 = time.time()
    make_model(args.dir, args.ebb, 0, args.shape)
    print(f"model ready in {time.time() - t0:.0f} s", flush=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(0, 150000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    ref = reference(args.dir, prompts, args.new_tokens)
    # transformers' eager attention against its sdpa: the distance between
    # two bf16 implementations of the same model, for scale.
    eager = reference(args.dir, prompts, 0, "eager")
    floor = [abs(a - b) for r, e in zip(ref, eager) for a, b in zip(r["prompt_logprobs"], e["prompt_logprobs"])]
    print(f"transformers done at {time.time() - t0:.0f} s", flush=True)
    report = {"shape": args.shape, "prompts": args.prompts, "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "transformers_eager_vs_sdpa_mean": sum(floor) / len(floor), "tp": {}}
    first = None
    with open(args.log, "a") as log:
        for tp in [int(x) for x in args.tp.split(",")]:
            p, url, ready_s = serve(args.ebb, args.dir, tp, log)
            try:
                got = [post(url + "/generate", {"input_ids": q, "return_logprob": True, "logprob_start_len": 0,
                                                "top_logprobs_num": 2,
                                                "sampling_params": {"temperature": 0, "max_new_tokens": args.new_tokens,
                                                                    "ignore_eos": True}}) for q in prompts]
                diffs, vs_tf, gaps, ids, lps, own_gaps = [], [], [], [], [], []
                for r, g in zip(ref, got):
                    lp = [x[0] for x in g["meta_info"]["input_token_logprobs"]][1:]
                    diffs += [abs(a - b) for a, b in zip(lp, r["prompt_logprobs"])]
                    n = agree(g["output_ids"], r["output_ids"])
                    vs_tf.append(n)
                    gaps.append(r["top2_gap"][n] if n < len(r["top2_gap"]) else None)
                    ids.append(g["output_ids"])
                    lps.append(lp)
                    own_gaps.append([t[0][0] - t[1][0] for t in g["meta_info"]["output_top_logprobs"]])
                rec = {"ready_s": round(ready_s, 1), "mean_abs_logprob_diff_vs_transformers": sum(diffs) / len(diffs),
                       "max_abs_logprob_diff": max(diffs), "greedy_agree_with_transformers": vs_tf,
                       "transformers_top2_gap_at_divergence": gaps}
                if first is None:
                    first = (ids, lps, own_gaps)
                else:
                    agreed = [agree(a, b) for a, b in zip(ids, first[0])]
                    rec["greedy_agree_with_tp1"] = agreed
                    rec["greedy_equal_tp1"] = ids == first[0]
                    # TP=1's own top-2 logprob gap where the two part: a near-tie there
                    rec["tp1_top2_gap_at_divergence"] = [g[n] if n < len(g) else None for n, g in zip(agreed, first[2])]
                    d1 = [abs(a - b) for x, y in zip(lps, first[1]) for a, b in zip(x, y)]
                    rec["mean_abs_logprob_diff_vs_tp1"] = sum(d1) / len(d1)
                print(f"tp {tp}: {json.dumps(rec)}", flush=True)
                if not args.no_bench:
                    b1 = bench(args.ebb, url, 1, 128, 256)
                    b256 = bench(args.ebb, url, 256, 128, 128)
                    for b in (b1, b256):
                        b.pop("throughput_series", None)
                    rec["batch1_itl_ms"] = b1["itl_ms"]
                    rec["batch1_output_tokens_per_s"] = b1["output_tokens_per_s"]
                    rec["batch256_output_tokens_per_s"] = b256["output_tokens_per_s"]
                    rec["batch256"] = b256
                    print(f"tp {tp}: batch-1 ITL p50 {b1['itl_ms']['p50']:.3f} ms, batch-256 "
                          f"{b256['output_tokens_per_s']:.0f} out tok/s ({b256['failed']} failed)", flush=True)
                report["tp"][tp] = rec
            finally:
                p.terminate()
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    print(f"done at {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
