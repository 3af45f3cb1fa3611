#!/usr/bin/env python3
"""Reference outputs from transformers for ebb tiny models.

Run on the GPU machine (it has transformers and torch), with an ebb binary:

    python3 tools/golden_tiny.py --ebb ebb --cases testdata/goldens/cases.json --out OUTDIR

For each case it writes the model with `ebb tiny-model --spec`, runs
transformers in float32 on the CPU with eager attention (no TF32, no fused
kernels) and records, per prompt: 32 greedy tokens, their logprobs, the
top-1/top-2 logprob gap of each step (to recognise near-ties) and the
teacher-forced logprob of every prompt token; for mixture-of-experts models
also the experts every token but the last was routed to in every layer
(SGLang's routed_experts layout, -1 in dense layers) with the margin of
each choice. tests read OUTDIR/<name>.json.

With --random N it also draws N fresh random configurations, runs
`ebb generate --device cpu` on them and compares against transformers
directly, printing one line per configuration: the goldens are not the only
configurations that match.
"""
import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile

import torch
from transformers import AutoModelForCausalLM

NEW_TOKENS = 32
PROMPT_LENGTHS = [1, 7, 33, 130]


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_model(ebb, spec, path):
    subprocess.run([ebb, "tiny-model", path, "--spec", json.dumps(spec)], check=True, stdout=subprocess.DEVNULL)


def prompts_for(seed, vocab_limit):
    rng = random.Random(seed)
    return [[rng.randrange(0, vocab_limit) for _ in range(n)] for n in PROMPT_LENGTHS]


@torch.no_grad()
def routing(model, ids, device):
    """The experts each token of ids was routed to in every layer, [T][L][k]
    (-1 in dense layers), and each choice's margin [T][L]: the smallest gap
    between neighbouring probabilities among the top k+1, below which float
    noise may reorder or swap them."""
    layers = model.model.layers
    seen = {}
    hooks = []
    for i, layer in enumerate(layers):
        mlp = layer.mlp
        if hasattr(mlp, "experts") and hasattr(mlp, "gate"):
            def hook(mod, args, out, i=i):
                seen[i] = args[0].reshape(-1, args[0].shape[-1])
            hooks.append(mlp.gate.register_forward_hook(hook))
    model(torch.tensor([ids], device=device))
    for h in hooks:
        h.remove()
    k = model.config.num_experts_per_tok
    n = len(ids)
    experts = [[[-1] * k for _ in layers] for _ in range(n)]
    margins = [[1.0 for _ in layers] for _ in range(n)]
    for i, x in seen.items():
        gate = layers[i].mlp.gate
        probs = torch.softmax(torch.nn.functional.linear(x, gate.weight).float(), dim=-1)
        top = torch.topk(probs, min(k + 1, probs.shape[-1]), dim=-1)
        gaps = top.values[:, :-1] - top.values[:, 1:]
        for t in range(n):
            experts[t][i] = [int(e) for e in top.indices[t, :k]]
            margins[t][i] = float(gaps[t].min()) if gaps.shape[1] > 0 else 1.0
    return experts, margins


@torch.no_grad()
def reference(model_dir, prompts, dtype=torch.float32, device="cpu", attn="eager"):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn).to(device)
    model.eval()
    moe = hasattr(model.config, "num_experts_per_tok")
    cases = []
    for p in prompts:
        logits = model(torch.tensor([p], device=device)).logits[0].float()
        lp = torch.log_softmax(logits, dim=-1)
        prompt_lp = [float(lp[i, p[i + 1]]) for i in range(len(p) - 1)]
        cur, toks, lps, gaps = list(p), [], [], []
        past = None
        ids = torch.tensor([cur], device=device)
        for _ in range(NEW_TOKENS):
            out = model(ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            step_lp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
            top = torch.topk(step_lp, 2)
            t = int(top.indices[0])
            toks.append(t)
            lps.append(float(top.values[0]))
            gaps.append(float(top.values[0] - top.values[1]))
            ids = torch.tensor([[t]], device=device)
        case = {"input_ids": p, "output_ids": toks, "output_logprobs": lps,
                "top2_gap": gaps, "prompt_logprobs": prompt_lp}
        if moe:
            case["routed_experts"], case["router_margin"] = routing(model, p + toks[:-1], device)
        cases.append(case)
    return cases


def spread(a, b):
    """Mean and max |logprob difference| between two runs over the prompt
    tokens and the output steps before their tokens first differ."""
    diffs = []
    for x, y in zip(a, b):
        diffs += [abs(p - q) for p, q in zip(x["prompt_logprobs"], y["prompt_logprobs"])]
        for i, (s, t) in enumerate(zip(x["output_ids"], y["output_ids"])):
            if s != t:
                break
            diffs.append(abs(x["output_logprobs"][i] - y["output_logprobs"][i]))
    return {"mean": sum(diffs) / len(diffs), "max": max(diffs), "n": len(diffs)}


def vocab_limit(spec):
    return 150000 if spec["arch"] in ("qwen3", "qwen3_moe", "qwen2", "qwen2_moe") else 128000


def goldens(args):
    cases = json.load(open(args.cases))
    os.makedirs(args.out, exist_ok=True)
    for i, case in enumerate(cases):
        if args.only and case["name"] not in args.only.split(","):
            continue
        with tempfile.TemporaryDirectory() as d:
            write_model(args.ebb, case["spec"], d)
            prompts = prompts_for(1000 + i, vocab_limit(case["spec"]))
            result = {"name": case["name"], "spec": case["spec"],
                      "weights_sha256": sha256(os.path.join(d, "model.safetensors")),
                      "new_tokens": NEW_TOKENS, "cases": reference(d, prompts)}
            if torch.cuda.is_available():
                # What a bf16 engine is compared with: transformers in bf16
                # (its default sdpa attention), and how far transformers'
                # own eager attention is from it: the noise floor of bf16.
                result["bf16_cases"] = reference(d, prompts, torch.bfloat16, "cuda", "sdpa")
                eager = reference(d, prompts, torch.bfloat16, "cuda", "eager")
                result["bf16_floor"] = spread(result["bf16_cases"], eager)
        with open(os.path.join(args.out, case["name"] + ".json"), "w") as f:
            json.dump(result, f)
        print(f"{case['name']}: {len(result['cases'])} prompts", flush=True)


def random_spec(rng, i):
    arch = rng.choice(["qwen3", "qwen2", "llama"])
    kv = rng.choice([1, 2, 4])
    heads = kv * rng.choice([1, 2, 3])
    spec = {"arch": arch, "heads": heads, "kv_heads": kv, "head_dim": rng.choice([8, 16, 24, 48]),
            "hidden": rng.choice([32, 64, 80]), "intermediate": rng.choice([64, 160]),
            "layers": rng.choice([1, 2, 3]), "tie": rng.random() < 0.5, "seed": 100 + i,
            "dtype": rng.choice(["BF16", "F32"])}
    if arch != "qwen2":
        spec["attention_bias"] = rng.random() < 0.3
    if arch == "llama":
        spec["rope"] = rng.choice(["", "linear", "llama3"])
    return spec


def random_check(args):
    rng = random.Random(args.random_seed)
    worst_all, failures = 0.0, 0
    for i in range(args.random):
        spec = random_spec(rng, i)
        with tempfile.TemporaryDirectory() as d:
            write_model(args.ebb, spec, d)
            prompts = prompts_for(5000 + i, vocab_limit(spec))[1:3]
            ref = reference(d, prompts)
            cmd = [args.ebb, "generate", "--model", d, "--device", "cpu", "--temperature", "0", "--ignore-eos",
                   "--max-new-tokens", str(NEW_TOKENS), "--return-logprob", "--json"]
            for p in prompts:
                cmd += ["--input-ids", ",".join(map(str, p))]
            got = [json.loads(l) for l in subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()]
        worst, exact = 0.0, True
        for r, g in zip(ref, got):
            n = NEW_TOKENS
            for j, gap in enumerate(r["top2_gap"]):
                if gap < 1e-4:  # a near-tie: float noise may pick either token
                    n = j
                    break
            exact &= g["output_ids"][:n] == r["output_ids"][:n]
            for j in range(n):
                worst = max(worst, abs(g["meta_info"]["output_token_logprobs"][j][0] - r["output_logprobs"][j]))
        ok = exact and worst < 1e-3
        failures += not ok
        worst_all = max(worst_all, worst)
        print(f"random {i}: {json.dumps(spec)} tokens {'exact' if exact else 'DIFFER'} max|dlogprob| {worst:.2e}", flush=True)
    print(f"random configurations: {args.random - failures}/{args.random} match, worst |dlogprob| {worst_all:.2e}")
    return failures


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ebb", default="ebb")
    ap.add_argument("--cases", default="testdata/goldens/cases.json")
    ap.add_argument("--out", default="testdata/goldens")
    ap.add_argument("--only", default="", help="comma-separated case names to regenerate (default: all)")
    ap.add_argument("--random", type=int, default=0)
    ap.add_argument("--random-seed", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(min(8, os.cpu_count() or 1))
    goldens(args)
    if args.random and random_check(args):
        sys.exit(1)


if __name__ == "__main__":
    main()
