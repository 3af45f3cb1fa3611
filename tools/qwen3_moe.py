#!/usr/bin/env python3
"""Qwen3-30B-A3B-shaped models for ebb, and ebb checked against transformers
(bf16) on a short copy. Run on the GPU machine (an H200 for the full shape):

    # config and tokenizer only: serve with --load-format dummy
    python3 tools/qwen3_moe.py --dir /tmp/q30a3 --ebb ebb --config-only
    # a 4-layer copy with real random weights, checked against transformers
    python3 tools/qwen3_moe.py --dir /tmp/q30a3-l4 --ebb ebb --layers 4 --out report.json

The shape is Qwen3-30B-A3B's: 48 layers, hidden 2048, 32 query / 4 KV heads,
head_dim 128, 128 experts of which 8 are active (moe_intermediate 768,
norm_topk_prob), vocab 151936, untied. Its bf16 weights are 61 GB, more than
the device's disk: the full model is served from config.json alone.

With weights, every linear weight is drawn with variance 1/fan_in (the
router too, so tokens spread over the experts as a trained router spreads
them) and the embedding so that logits spread over a few nats. The check:
transformers in bf16 (sdpa, and eager for the noise floor of two bf16
implementations) gives teacher-forced logprobs of random prompts, greedy
continuations and the experts each token was routed to in every layer
(with the margin of each choice); `ebb generate --device cuda` gives the
same, and the report says how far apart they are and how many routing
choices agree where the margin exceeds bf16 noise: the widest margin (a
gap between neighbouring router logits) at which transformers' eager and
sdpa attention, two faithful bf16 implementations, route differently.
"""
import argparse
import base64
import json
import os
import random
import struct
import subprocess

import torch

from qwen3_06b import init_weights, model_written, need_ebb, tokenizer_files

SHAPE = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
             num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
             moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
             vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
             tie_word_embeddings=False, attention_bias=False, hidden_act="silu", bos_token_id=151643,
             eos_token_id=151645, torch_dtype="bfloat16", architectures=["Qwen3MoeForCausalLM"],
             model_type="qwen3_moe", output_router_logits=False, router_aux_loss_coef=0.001)



def make_model(path, ebb, layers, config_only, seed):
    if model_written(path, config_only):
        return
    need_ebb(ebb)
    os.makedirs(path, exist_ok=True)
    shape = dict(SHAPE, num_hidden_layers=layers)
    if config_only:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(shape, f, indent=2)
        tokenizer_files(ebb, path)
        return
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    cfg = Qwen3MoeConfig(**{k: v for k, v in shape.items() if k not in ("architectures", "model_type", "torch_dtype")})
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Qwen3MoeForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    init_weights(model, cfg.hidden_size)  # the router's too: tokens spread over the experts
    model.save_pretrained(path, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    tokenizer_files(ebb, path)


@torch.no_grad()
def routing(model, ids):
    """Experts each token of ids was routed to, [T][L][k], and margins [T][L]:
    the smallest gap between neighbouring router logits among the top k+1."""
    layers = model.model.layers
    seen, hooks = {}, []
    for i, layer in enumerate(layers):
        if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts"):
            def hook(mod, args, out, i=i):
                seen[i] = args[0].reshape(-1, args[0].shape[-1])
            hooks.append(layer.mlp.gate.register_forward_hook(hook))
    model(torch.tensor([ids], device="cuda"))
    for h in hooks:
        h.remove()
    k = model.config.num_experts_per_tok
    experts = [[[-1] * k for _ in layers] for _ in ids]
    margins = [[1.0 for _ in layers] for _ in ids]
    for i, x in seen.items():
        logp = torch.log_softmax(torch.nn.functional.linear(x, layers[i].mlp.gate.weight).float(), dim=-1)
        top = torch.topk(logp, k + 1, dim=-1)
        gaps = (top.values[:, :-1] - top.values[:, 1:]).min(dim=-1).values
        for t in range(len(ids)):
            experts[t][i] = [int(e) for e in top.indices[t, :k]]
            margins[t][i] = float(gaps[t])
    return experts, margins


@torch.no_grad()
def reference(path, prompts, new_tokens, attn):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda", attn_implementation=attn)
    model.eval()
    out = []
    for p in prompts:
        lp = torch.log_softmax(model(torch.tensor([p], device="cuda")).logits[0].float(), dim=-1)
        prompt_lp = [float(lp[i, p[i + 1]]) for i in range(len(p) - 1)]
        toks, gaps, past, cur = [], [], None, torch.tensor([p], device="cuda")
        for _ in range(new_tokens):
            o = model(cur, past_key_values=past, use_cache=True)
            past = o.past_key_values
            top = torch.topk(torch.log_softmax(o.logits[0, -1].float(), dim=-1), 2)
            toks.append(int(top.indices[0]))
            gaps.append(float(top.values[0] - top.values[1]))
            cur = torch.tensor([[toks[-1]]], device="cuda")
        experts, margins = routing(model, p + toks[:-1])
        out.append({"prompt_logprobs": prompt_lp, "output_ids": toks, "top2_gap": gaps,
                    "experts": experts, "margins": margins})
    del model
    torch.cuda.empty_cache()
    return out


def run_ebb(ebb, path, prompts, new_tokens):
    cmd = [ebb, "generate", "--model", path, "--device", "cuda", "--temperature", "0", "--ignore-eos",
           "--max-new-tokens", str(new_tokens), "--return-logprob", "--logprob-start-len", "0",
           "--return-routed-experts", "--json"]
    for p in prompts:
        cmd += ["--input-ids", ",".join(map(str, p))]
    res = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return [json.loads(l) for l in res.stdout.splitlines()]


def decode_routed(s, layers, k):
    raw = base64.b64decode(s)
    flat = struct.unpack("<%di" % (len(raw) // 4), raw)
    return [[list(flat[(t * layers + l) * k:(t * layers + l + 1) * k]) for l in range(layers)]
            for t in range(len(flat) // (layers * k))]


def agreeing(a, b):
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


def compare(args, prompts):
    ref = reference(args.dir, prompts, args.new_tokens, "sdpa")
    eager = reference(args.dir, prompts, args.new_tokens, "eager")
    got = run_ebb(args.ebb, args.dir, prompts, args.new_tokens)
    layers, k = args.layers, SHAPE["num_experts_per_tok"]
    floor = [abs(a - b) for r, e in zip(ref, eager) for a, b in zip(r["prompt_logprobs"], e["prompt_logprobs"])]
    # bf16 noise: the widest margin at which eager and sdpa route apart.
    noise, pairs, apart = 0.0, 0, 0
    for p, r, e in zip(prompts, ref, eager):
        for t in range(len(p) + agreeing(r["output_ids"], e["output_ids"]) - 1):
            for l in range(layers):
                pairs += 1
                if r["experts"][t][l] != e["experts"][t][l]:
                    apart += 1
                    noise = max(noise, r["margins"][t][l])
    diffs, agree, routed_same, routed_checked, ebb_pairs, ebb_apart = [], [], 0, 0, 0, 0
    for p, r, g in zip(prompts, ref, got):
        ebb_lp = [x[0] for x in g["meta_info"]["input_token_logprobs"]][1:]
        diffs += [abs(a - b) for a, b in zip(ebb_lp, r["prompt_logprobs"])]
        n = agreeing(r["output_ids"], g["output_ids"])
        agree.append(n)
        routed = decode_routed(g["meta_info"]["routed_experts"], layers, k)
        for t in range(min(len(routed), len(p) + n - 1)):
            for l in range(layers):
                ebb_pairs += 1
                ebb_apart += routed[t][l] != r["experts"][t][l]
                if r["margins"][t][l] <= noise:
                    continue
                routed_checked += 1
                routed_same += routed[t][l] == r["experts"][t][l]
    summary = {"mean_abs_logprob_diff": sum(diffs) / len(diffs), "max_abs_logprob_diff": max(diffs),
               "transformers_eager_vs_sdpa_mean": sum(floor) / len(floor),
               "transformers_eager_vs_sdpa_max": max(floor),
               "greedy_agree_tokens": agree, "routing_checked": routed_checked, "routing_equal": routed_same,
               "bf16_routing_noise_margin": noise, "eager_vs_sdpa_routing_apart": [apart, pairs],
               "ebb_vs_sdpa_routing_apart": [ebb_apart, ebb_pairs]}
    summary["pass"] = (summary["mean_abs_logprob_diff"] <= max(0.02, 1.5 * summary["transformers_eager_vs_sdpa_mean"])
                       and routed_same == routed_checked and routed_checked > 0)
    print(json.dumps(summary, indent=1))
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)
    return summary["pass"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/qwen3-30b-a3b")
    ap.add_argument("--ebb", default="ebb")
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--config-only", action="store_true", help="write config.json and the tokenizer, no weights")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="qwen3_moe_report.json")
    args = ap.parse_args()
    make_model(args.dir, args.ebb, args.layers, args.config_only, args.seed)
    if args.config_only:
        return
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(0, 150000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    raise SystemExit(0 if compare(args, prompts) else 1)


if __name__ == "__main__":
    main()
