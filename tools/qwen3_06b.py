#!/usr/bin/env python3
"""A Qwen3-0.6B-shaped model with random weights, and ebb checked against
transformers (bf16) on it. Run on the GPU machine:

    python3 tools/qwen3_06b.py --dir /tmp/qwen3-0.6b --ebb ebb --out report.json

1. Writes the model directory (exact Qwen3-0.6B shapes: 28 layers, hidden
   1024, 16 query / 8 KV heads, head_dim 128, intermediate 3072, vocab
   151936, tied embeddings) in bf16 safetensors, with Qwen3's tokenizer files
   taken from an `ebb tiny-model` directory. Linear weights are drawn with
   variance 1/fan_in and the embedding so that logits spread over a few nats
   (not the near-uniform default init), which makes greedy decoding and
   logprob comparisons meaningful.
2. transformers (bf16, CUDA, its default sdpa attention): teacher-forced
   logprobs of random prompts and greedy continuations with the
   top-1/top-2 gap of each step; and the same with eager attention, whose
   distance from sdpa is the noise floor of two bf16 implementations.
   Teacher-forced float32 logprobs on the same weights measure how far each
   bf16 implementation (transformers' and ebb's) is from the exact answer.
3. `ebb generate --device cuda` on the same prompts (prompt logprobs from
   position 0, greedy continuation), in its own process after torch has
   released the GPU.
4. Reports the mean |logprob difference| over prompt tokens and how far the
   greedy continuations agree, with the gap where they first differ.
"""
import argparse
import json
import math
import os
import random
import shutil
import subprocess
import tempfile

import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM


# Qwen3 shapes by name: the default 0.6B, and 8B for tensor parallelism.
SHAPES = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=False),
}


@torch.no_grad()
def init_weights(model, hidden):
    """Norms near one, every other weight with variance 1/fan_in (its last
    dimension), the embedding and lm_head so that logits spread over a few
    nats."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.normal_(1.0, 0.1)
        elif "embed_tokens" in name or "lm_head" in name:
            p.normal_(0.0, 4.8 / math.sqrt(hidden))
        else:
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))


def make_model(path, ebb, seed, shape="0.6b", config_only=False):
    if model_written(path, config_only):
        return
    need_ebb(ebb)
    cfg = Qwen3Config(vocab_size=151936, head_dim=128, max_position_embeddings=40960,
                      rope_theta=1000000.0, rms_norm_eps=1e-6, bos_token_id=151643,
                      eos_token_id=151645, attention_bias=False, hidden_act="silu", **SHAPES[shape])
    if config_only:  # served with --load-format dummy
        cfg.architectures, cfg.torch_dtype = ["Qwen3ForCausalLM"], "bfloat16"
        cfg.save_pretrained(path)
        tokenizer_files(ebb, path)
        return
    torch.manual_seed(seed)
    torch.set_default_dtype(torch.bfloat16)  # an 8B model in float32 would be 32 GB
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    init_weights(model, cfg.hidden_size)
    model.save_pretrained(path, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    tokenizer_files(ebb, path)


def model_written(path, config_only):
    """Whether path already holds what was asked: the tokenizer is written
    last, and a directory written with --config-only (for --load-format
    dummy) has no weights, so a later full model is written over it rather
    than taken as done."""
    if not os.path.exists(os.path.join(path, "tokenizer.json")):
        return False
    return config_only or any(f.endswith(".safetensors") for f in os.listdir(path))


def need_ebb(ebb):
    """Stops before anything is written where ebb, which writes the tokenizer
    files, is not found: a directory with a config but no tokenizer or
    generation_config.json still loads, with other sampling defaults."""
    if shutil.which(ebb) is None:
        raise SystemExit(f"{ebb}: not found (the tokenizer files come from `ebb tiny-model`); put ebb on PATH or pass --ebb")


def tokenizer_files(ebb, path):
    """Qwen3's tokenizer files, from an `ebb tiny-model` directory."""
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([ebb, "tiny-model", d, "--arch", "qwen3"], check=True, stdout=subprocess.DEVNULL)
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            shutil.copy(os.path.join(d, f), os.path.join(path, f))


@torch.no_grad()
def reference(path, prompts, new_tokens, attn="sdpa", dtype=torch.bfloat16):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map="cuda", attn_implementation=attn)
    model.eval()
    out = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        lp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        prompt_lp = [float(lp[i, p[i + 1]]) for i in range(len(p) - 1)]
        toks, gaps, past, cur = [], [], None, ids
        for _ in range(new_tokens):
            o = model(cur, past_key_values=past, use_cache=True)
            past = o.past_key_values
            step = torch.log_softmax(o.logits[0, -1].float(), dim=-1)
            top = torch.topk(step, 2)
            t = int(top.indices[0])
            toks.append(t)
            gaps.append(float(top.values[0] - top.values[1]))
            cur = torch.tensor([[t]], device="cuda")
        out.append({"prompt_logprobs": prompt_lp, "output_ids": toks, "top2_gap": gaps})
    del model
    torch.cuda.empty_cache()
    return out


def run_ebb(ebb, path, prompts, new_tokens):
    cmd = [ebb, "generate", "--model", path, "--device", "cuda", "--temperature", "0", "--ignore-eos",
           "--max-new-tokens", str(new_tokens), "--return-logprob", "--logprob-start-len", "0", "--json"]
    for p in prompts:
        cmd += ["--input-ids", ",".join(map(str, p))]
    res = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return [json.loads(l) for l in res.stdout.splitlines()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/qwen3-0.6b")
    ap.add_argument("--ebb", default="ebb")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="qwen3_06b_report.json")
    ap.add_argument("--shape", default="0.6b", choices=sorted(SHAPES))
    ap.add_argument("--make-only", action="store_true", help="write the model directory and stop")
    ap.add_argument("--config-only", action="store_true",
                    help="write config.json and the tokenizer only (serve with --load-format dummy), and stop")
    args = ap.parse_args()
    make_model(args.dir, args.ebb, args.seed, args.shape, args.config_only)
    if args.make_only or args.config_only:
        return
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(0, 150000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    ref = reference(args.dir, prompts, args.new_tokens)
    eager = reference(args.dir, prompts, args.new_tokens, "eager")
    # float32 on the same bf16 weights: the closest thing to the exact answer, against which
    # ebb and transformers, both bf16, can each be measured.
    exact = reference(args.dir, prompts, 0, dtype=torch.float32)
    floor = [abs(a - b) for r, e in zip(ref, eager) for a, b in zip(r["prompt_logprobs"], e["prompt_logprobs"])]
    got = run_ebb(args.ebb, args.dir, prompts, args.new_tokens)
    diffs, agree, report, ebb_exact = [], [], [], []
    tf_exact = [abs(a - b) for r, e in zip(ref, exact) for a, b in zip(r["prompt_logprobs"], e["prompt_logprobs"])]
    for r, g, e in zip(ref, got, exact):
        ebb_lp = [x[0] for x in g["meta_info"]["input_token_logprobs"]][1:]
        ebb_exact += [abs(a - b) for a, b in zip(ebb_lp, e["prompt_logprobs"])]
        d = [abs(a - b) for a, b in zip(ebb_lp, r["prompt_logprobs"])]
        diffs += d
        n = 0
        while n < len(r["output_ids"]) and g["output_ids"][n] == r["output_ids"][n]:
            n += 1
        gap = r["top2_gap"][n] if n < len(r["output_ids"]) else None
        agree.append(n)
        report.append({"agree_tokens": n, "gap_at_divergence": gap, "mean_abs_logprob_diff": sum(d) / len(d)})
        print(f"prompt: teacher-forced mean |dlogprob| {sum(d)/len(d):.4f}, greedy agrees for {n}/{len(r['output_ids'])} tokens"
              + (f" (transformers' top-2 gap there: {gap:.3f})" if gap is not None else ""), flush=True)
    summary = {"mean_abs_logprob_diff": sum(diffs) / len(diffs), "max_abs_logprob_diff": max(diffs),
               "transformers_eager_vs_sdpa_mean": sum(floor) / len(floor),
               "ebb_vs_fp32_mean": sum(ebb_exact) / len(ebb_exact),
               "transformers_bf16_vs_fp32_mean": sum(tf_exact) / len(tf_exact),
               "greedy_agree_tokens": agree, "prompts": report, "prompt_len": args.prompt_len,
               "new_tokens": args.new_tokens}
    print(f"mean |dlogprob| over {len(diffs)} prompt tokens: {summary['mean_abs_logprob_diff']:.4f} "
          f"(max {summary['max_abs_logprob_diff']:.3f}); greedy agreement {agree}; "
          f"transformers eager vs sdpa: {summary['transformers_eager_vs_sdpa_mean']:.4f}; against float32: "
          f"ebb {summary['ebb_vs_fp32_mean']:.4f}, transformers bf16 {summary['transformers_bf16_vs_fp32_mean']:.4f}")
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
