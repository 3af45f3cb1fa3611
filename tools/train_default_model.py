#!/usr/bin/env python3
"""Trains ebb's default model: a small Qwen3 on Go's source tree. GPU machine:

    python3 tools/train_default_model.py --corpus .device/corpus.jsonl.xz --out $OUT/model \
        --seconds 150 --ebb ebb --report $OUT/train.json

1. A byte-level BPE vocabulary of 4,096 tokens (Hugging Face tokenizers; Qwen's
   pre-tokenizer pattern and NFC, so ebb's tokenizer loads it), with Qwen3's
   chat tokens (<|im_start|>, <|im_end|>, <think>, <tool_call>, ...), so the
   model serves Qwen3's chat template.
2. A Qwen3ForCausalLM of about 15M parameters (8 layers, hidden 384, 6 query
   and 2 KV heads of 64, intermediate 1152, tied embeddings), trained for a
   fixed time budget on 512-token windows with AdamW and a cosine schedule,
   bf16 autocast, on 98% of the documents; the rest measure validation loss.
3. The model directory (bf16 safetensors, config, generation config,
   tokenizer.json, tokenizer_config.json with Qwen3's chat template).
4. Goldens for ebb's tests (testdata/goldens/default-model.json): greedy
   continuations and teacher-forced logprobs of validation text in float32
   (CPU, eager) and bf16 (CUDA, sdpa), with transformers' own eager-vs-sdpa
   spread as the bf16 noise floor.
5. With --ebb: ebb (CUDA, bf16) against transformers bf16 on held-out text:
   teacher-forced mean |dlogprob| and greedy agreement (tools/qwen3_06b.py).

The corpus (tools/make_go_corpus.py) is the Go source tree, BSD-3-Clause.
"""
import argparse
import hashlib
import json
import lzma
import math
import os
import random
import sys
import time

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import golden_tiny  # noqa: E402

QWEN_PATTERN = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added tokens that are text to the chat template and the tool parser, as in Qwen3.
PLAIN_ADDED = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
VOCAB = 4096


def load(corpus):
    with lzma.open(corpus, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def is_validation(path):
    return int(hashlib.sha256(path.encode()).hexdigest(), 16) % 50 == 0


def train_tokenizer(texts):
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, min_frequency=2, show_progress=False,
                                  special_tokens=SPECIAL + PLAIN_ADDED,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    # The trainer marks every added token special; the chat and tool tokens
    # are text in Qwen3 (skip_special_tokens keeps them).
    spec = json.loads(tok.to_str())
    for a in spec["added_tokens"]:
        a["special"] = a["content"] in SPECIAL
    return Tokenizer.from_str(json.dumps(spec)), spec


def token_stream(tok, docs, eos):
    enc = tok.encode_batch([d["text"] for d in docs], add_special_tokens=False)
    out = []
    for e in enc:
        out.extend(e.ids)
        out.append(eos)
    return torch.tensor(out, dtype=torch.int32)


def model_config(eos, im_end):
    return Qwen3Config(vocab_size=VOCAB, hidden_size=384, intermediate_size=1152, num_hidden_layers=8,
                       num_attention_heads=6, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                       rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=eos,
                       eos_token_id=[eos, im_end], attention_bias=False, hidden_act="silu")


@torch.no_grad()
def val_loss(model, data, seq, batches=20):
    model.eval()
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(batches):
        idx = torch.randint(0, len(data) - seq - 1, (32,), generator=g)
        x = torch.stack([data[i:i + seq + 1] for i in idx.tolist()]).long().cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x[:, :-1]).logits
        losses.append(torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), x[:, 1:].reshape(-1)).item())
    model.train()
    return sum(losses) / len(losses)


def train(model, data, val, seconds, seq, batch, lr):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    g = torch.Generator().manual_seed(1)

    def step(i, total):
        warm = 100
        scale = (i + 1) / warm if i < warm else 0.1 + 0.45 * (1 + math.cos(math.pi * (i - warm) / max(1, total - warm)))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        idx = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        x = torch.stack([data[j:j + seq + 1] for j in idx.tolist()]).long().cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    # Time a few steps after the first ones (which load kernels and
    # heuristics), then plan the schedule to fill the budget.
    for i in range(5):
        step(i, 10_000)
    torch.cuda.synchronize()
    t0 = time.time()
    for i in range(5, 20):
        step(i, 10_000)
    torch.cuda.synchronize()
    per = (time.time() - t0) / 15
    total = max(200, int(seconds / per))
    log = []
    start = time.time()
    for i in range(20, total):
        loss = step(i, total)
        if i % 500 == 0 or i == total - 1:
            entry = {"step": i, "loss": round(loss.item(), 4), "seconds": round(time.time() - start, 1)}
            if i % 2000 == 0 or i == total - 1:
                entry["val_loss"] = round(val_loss(model, val, seq), 4)
            log.append(entry)
            print(json.dumps(entry), flush=True)
    return {"steps": total, "step_ms": round(per * 1000, 2), "tokens": total * batch * seq, "log": log}


def write_model(model, tok_spec, out, qwen3_tokenizer_config, eos_ids):
    os.makedirs(out, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        json.dump(tok_spec, f, ensure_ascii=False)
    qcfg = json.load(open(qwen3_tokenizer_config))
    added = {str(a["id"]): {k: a[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
             for a in tok_spec["added_tokens"]}
    cfg = {"add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
           "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": None,
           "chat_template": qcfg["chat_template"], "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>",
           "errors": "replace", "model_max_length": 4096, "pad_token": "<|endoftext|>", "split_special_tokens": False,
           "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=1, ensure_ascii=False)
    gen = {"bos_token_id": eos_ids[0], "eos_token_id": eos_ids, "do_sample": True, "temperature": 0.7,
           "top_p": 0.95, "top_k": 40}
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=1)


GOLDEN_TEXTS = ["package", "func (s *Server) handle(", "// Copyright 2009 The Go Authors. All rights reserved.\n"
                "// Use of this source code is governed by a BSD-style\n// license that can be found in the LICENSE file.\n\n"]


def golden_prompts(tok, val_docs):
    prompts = [tok.encode(t, add_special_tokens=False).ids for t in GOLDEN_TEXTS]
    doc = sorted(val_docs, key=lambda d: d["path"])[0]
    prompts.append(tok.encode(doc["text"], add_special_tokens=False).ids[:200])
    return prompts


def goldens(model_dir, tok, val_docs, path):
    prompts = golden_prompts(tok, val_docs)
    result = {"name": "default-model", "weights_sha256": golden_tiny.sha256(os.path.join(model_dir, "model.safetensors")),
              "new_tokens": golden_tiny.NEW_TOKENS, "prompt_texts": GOLDEN_TEXTS,
              "cases": golden_tiny.reference(model_dir, prompts)}
    result["bf16_cases"] = golden_tiny.reference(model_dir, prompts, torch.bfloat16, "cuda", "sdpa")
    eager = golden_tiny.reference(model_dir, prompts, torch.bfloat16, "cuda", "eager")
    result["bf16_floor"] = golden_tiny.spread(result["bf16_cases"], eager)
    with open(path, "w") as f:
        json.dump(result, f)
    return result


def sample(model, tok, prompt, n=60):
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False).ids], device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return tok.decode(out[0].tolist(), skip_special_tokens=False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=150)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--goldens", default="")
    ap.add_argument("--ebb", default="")
    ap.add_argument("--report", default="train_report.json")
    ap.add_argument("--qwen3-tokenizer-config", default="assets/qwen3/tokenizer_config.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    random.seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    t0 = time.time()
    docs = load(args.corpus)
    train_docs = [d for d in docs if not is_validation(d["path"])]
    val_docs = [d for d in docs if is_validation(d["path"])]
    tok, spec = train_tokenizer(d["text"] for d in train_docs)
    eos, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    data = token_stream(tok, train_docs, eos)
    val = token_stream(tok, val_docs, eos)
    report = {"documents": len(docs), "train_tokens": len(data), "val_tokens": len(val),
              "bytes_per_token": round(sum(len(d["text"].encode()) for d in train_docs) / len(data), 3),
              "tokenizer_seconds": round(time.time() - t0, 1)}
    print(json.dumps(report), flush=True)
    model = Qwen3ForCausalLM(model_config(eos, im_end)).cuda()
    report["parameters"] = sum(p.numel() for p in model.parameters())
    report["train"] = train(model, data, val, args.seconds, args.seq, args.batch, args.lr)
    report["val_loss"] = val_loss(model, val, args.seq, batches=50)
    model.eval()
    report["samples"] = {p: sample(model, tok, p) for p in ["package main\n\nimport (\n", "func main() {\n",
                                                             "// Sort sorts data in ascending order"]}
    write_model(model, spec, args.out, args.qwen3_tokenizer_config, [eos, im_end])
    del model
    torch.cuda.empty_cache()
    if args.goldens:
        g = goldens(args.out, tok, val_docs, args.goldens)
        report["golden_bf16_floor"] = g["bf16_floor"]
    if args.ebb:
        report["ebb_vs_transformers_bf16"] = compare_with_ebb(args.ebb, args.out, tok, val_docs)
    report["seconds"] = round(time.time() - t0, 1)
    with open(args.report, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "train"}, indent=1))


def compare_with_ebb(ebb, model_dir, tok, val_docs, n=8, length=256, new_tokens=64):
    import qwen3_06b
    prompts = []
    for d in sorted(val_docs, key=lambda d: d["path"])[1:]:
        ids = tok.encode(d["text"], add_special_tokens=False).ids
        if len(ids) >= length:
            prompts.append(ids[:length])
        if len(prompts) == n:
            break
    ref = qwen3_06b.reference(model_dir, prompts, new_tokens)
    eager = qwen3_06b.reference(model_dir, prompts, new_tokens, "eager")
    got = qwen3_06b.run_ebb(ebb, model_dir, prompts, new_tokens)
    diffs, floor, agree, gaps = [], [], [], []
    for r, e, g in zip(ref, eager, got):
        ebb_lp = [x[0] for x in g["meta_info"]["input_token_logprobs"]][1:]
        diffs += [abs(a - b) for a, b in zip(ebb_lp, r["prompt_logprobs"])]
        floor += [abs(a - b) for a, b in zip(e["prompt_logprobs"], r["prompt_logprobs"])]
        k = 0
        while k < new_tokens and g["output_ids"][k] == r["output_ids"][k]:
            k += 1
        agree.append(k)
        gaps.append(r["top2_gap"][k] if k < new_tokens else None)
    return {"prompts": len(prompts), "prompt_len": length, "tokens": len(diffs),
            "mean_abs_logprob_diff": sum(diffs) / len(diffs), "max_abs_logprob_diff": max(diffs),
            "transformers_eager_vs_sdpa_mean": sum(floor) / len(floor),
            "greedy_agree_tokens": agree, "new_tokens": new_tokens, "gap_at_divergence": gaps}


if __name__ == "__main__":
    main()
