#!/usr/bin/env python3
"""Deterministic inference checked against a running server
(`ebb serve --enable-deterministic-inference`):

    python3 tools/det_check.py --url http://127.0.0.1:30000 [--torch MODEL_DIR] [--out det.json]

1. Batch invariance: a 300-token prompt, 200 tokens greedy and 200 sampled
   (temperature 1, a sampling_seed, the model's top_k/top_p), alone and
   among 1, 7, 63 and 255 others of random lengths sent at the same time;
   then again with its prompt cached. Tokens and logprobs must be equal.
2. A 4,000-token prompt alone and among 31 others.
3. Decode against prefill: 64 prompts sampled for 1,000 tokens each (all at
   once), then each finished sequence sent back as a prompt with
   logprob_start_len 0: the logprob a token got as it was generated must
   equal the one the prefill gives it.
4. With --torch: the same 64 sequences through transformers in bf16 on the
   GPU (a trainer's forward), and ebb's decode logprobs' mean and max
   |difference| per token from it.

JSON floats carry a float32 exactly, so equal numbers are equal bits. The
script exits 1 when any check differs. Run it against a server without the
flag to see what the flag fixes (--expect-different skips the exit code).
"""
import argparse
import concurrent.futures as cf
import json
import random
import sys
import urllib.request


def post(url, body, timeout=1800):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def generate(url, ids, max_new, temperature, seed=None, start=-1, defaults=True):
    sp = {"max_new_tokens": max_new, "temperature": temperature, "ignore_eos": True}
    if seed is not None:
        sp["sampling_seed"] = seed
    if not defaults:
        sp.update(top_k=-1, top_p=1.0)
    body = {"input_ids": ids, "sampling_params": sp, "return_logprob": True}
    if start >= 0:
        body["logprob_start_len"] = start
    r = post(url + "/generate", body)
    meta = r["meta_info"]
    return {
        "ids": r["output_ids"],
        "out": [e[0] for e in meta.get("output_token_logprobs", [])],
        "input": [e[0] for e in meta.get("input_token_logprobs", [])],
        "cached": meta.get("cached_tokens", 0),
    }


def together(url, jobs):
    """Runs generate(url, *job) for every job at once; returns the results in order."""
    with cf.ThreadPoolExecutor(max_workers=len(jobs)) as ex:
        return list(ex.map(lambda j: generate(url, *j), jobs))


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def batch_invariance(url, rng, vocab, prompt_len, new, others_list, label):
    results = []
    target = [rng.randrange(vocab) for _ in range(prompt_len)]
    for temp, seed in ((0.0, None), (1.0, 1234)):
        # A fresh prefix per temperature keeps the first run uncached.
        ids = [rng.randrange(vocab)] + target
        alone = generate(url, ids, new, temp, seed)
        for others in others_list:
            jobs = [(ids, new, temp, seed)]
            for _ in range(others):
                n = rng.randrange(5, 1500)
                jobs.append(([rng.randrange(vocab) for _ in range(n)], rng.randrange(1, 400), rng.choice((0.0, 1.0)),
                             rng.randrange(1 << 30)))
            # The target at a random place among them.
            at = rng.randrange(len(jobs))
            jobs[0], jobs[at] = jobs[at], jobs[0]
            got = together(url, jobs)[at]
            d_tok, d_lp = first_difference(got["ids"], alone["ids"]), first_difference(got["out"], alone["out"])
            results.append({"check": label, "temperature": temp, "others": others, "cached": got["cached"],
                            "tokens_equal": d_tok is None, "logprobs_equal": d_lp is None,
                            "first_token_difference": d_tok, "first_logprob_difference": d_lp})
        again = generate(url, ids, new, temp, seed)  # its prompt is cached now
        d_tok, d_lp = first_difference(again["ids"], alone["ids"]), first_difference(again["out"], alone["out"])
        results.append({"check": label + ", prompt cached", "temperature": temp, "others": 0, "cached": again["cached"],
                        "tokens_equal": d_tok is None, "logprobs_equal": d_lp is None,
                        "first_token_difference": d_tok, "first_logprob_difference": d_lp})
    return results


def decode_vs_prefill(url, rng, vocab, n, new):
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(50, 200))] for _ in range(n)]
    runs = together(url, [(p, new, 1.0, 7000 + i) for i, p in enumerate(prompts)])
    seqs, equal, total, worst = [], 0, 0, 0.0
    scored = together(url, [(p + r["ids"], 1, 0.0, None, 0) for p, r in zip(prompts, runs)])
    for p, r, s in zip(prompts, runs, scored):
        pre = s["input"][len(p):len(p) + len(r["out"])]
        for a, b in zip(r["out"], pre):
            total += 1
            equal += a == b
            if a is not None and b is not None:
                worst = max(worst, abs(a - b))
        seqs.append({"prompt": p, "ids": r["ids"], "decode_logprobs": r["out"]})
    return {"sequences": n, "tokens": total, "equal": equal, "max_abs_difference": worst}, seqs


def torch_distance(model_dir, seqs):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16).cuda().eval()
    diffs = []
    with torch.no_grad():
        for s in seqs:
            full = torch.tensor([s["prompt"] + s["ids"]], device="cuda")
            logits = model(full).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1)
            p = len(s["prompt"])
            targets = full[0, p:]
            ref = lp[p - 1:p - 1 + len(targets)].gather(1, targets[:, None])[:, 0].tolist()
            diffs += [abs(a - b) for a, b in zip(s["decode_logprobs"], ref) if a is not None]
    return {"tokens": len(diffs), "mean_abs_difference": sum(diffs) / len(diffs), "max_abs_difference": max(diffs)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:30000")
    ap.add_argument("--vocab", type=int, default=151000, help="token ids are drawn below this")
    ap.add_argument("--torch", help="model directory: report the distance to transformers' bf16 logprobs")
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--length", type=int, default=1000)
    ap.add_argument("--quick", action="store_true", help="fewer and shorter requests")
    ap.add_argument("--expect-different", action="store_true", help="report only (a server without the flag)")
    ap.add_argument("--out")
    a = ap.parse_args()
    rng = random.Random(20261124)
    others = [1, 7] if a.quick else [1, 7, 63, 255]
    report = {"batch": batch_invariance(a.url, rng, a.vocab, 300, 50 if a.quick else 200, others, "300-token prompt")}
    report["batch"] += batch_invariance(a.url, rng, a.vocab, 4000, 50, [7] if a.quick else [31], "4000-token prompt")
    report["decode_vs_prefill"], seqs = decode_vs_prefill(a.url, rng, a.vocab, 8 if a.quick else a.sequences,
                                                         100 if a.quick else a.length)
    if a.torch:
        report["torch_bf16"] = torch_distance(a.torch, seqs)
    ok = all(r["tokens_equal"] and r["logprobs_equal"] for r in report["batch"])
    dp = report["decode_vs_prefill"]
    ok = ok and dp["equal"] == dp["tokens"]
    report["pass"] = ok
    for r in report["batch"]:
        print("%-30s T=%.0f others %3d cached %5d: tokens %s, logprobs %s" % (
            r["check"], r["temperature"], r["others"], r["cached"], "equal" if r["tokens_equal"] else
            "differ at %s" % r["first_token_difference"], "equal" if r["logprobs_equal"] else
            "differ at %s" % r["first_logprob_difference"]))
    print("decode vs prefill: %d of %d logprobs equal over %d sequences (max |diff| %.3g)" % (
        dp["equal"], dp["tokens"], dp["sequences"], dp["max_abs_difference"]))
    if "torch_bf16" in report:
        t = report["torch_bf16"]
        print("against transformers bf16: mean |diff| %.4f, max %.4f over %d tokens" % (
            t["mean_abs_difference"], t["max_abs_difference"], t["tokens"]))
    print("PASS" if ok else "DIFFERENT")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    sys.exit(0 if ok or a.expect_different else 1)


if __name__ == "__main__":
    main()
