#!/usr/bin/env python3
"""A Qwen2/Qwen3 (dense or mixture-of-experts) forward pass in plain PyTorch,
for machines without transformers (CI has Debian's python3-torch only):

    /usr/bin/python3 tools/moe_reference.py MODEL_DIR --prompts 1,7,33 [--seed 3] > golden.json

It follows transformers' Qwen2 / Qwen3 / Qwen2-MoE / Qwen3-MoE modelling code
in float32 on the CPU, reading config.json and model.safetensors itself, and
prints one golden in tools/golden_tiny.py's format (greedy tokens, their
logprobs and top-2 gaps, teacher-forced prompt logprobs, the experts each
token was routed to with the margin of each choice). engine's tests compare
ebb's CPU backend with it where no transformers golden exists yet (Qwen2-MoE),
and check it against the transformers goldens that do (Qwen3-MoE).
"""
import argparse
import json
import os
import random
import struct

import torch

NEW_TOKENS = 32


def load_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        lo, hi = t["data_offsets"]
        raw = bytearray(data[lo:hi])
        if t["dtype"] == "F32":
            v = torch.frombuffer(raw, dtype=torch.float32)
        elif t["dtype"] == "BF16":
            v = torch.frombuffer(raw, dtype=torch.int16).view(torch.bfloat16).float()
        else:
            raise ValueError(f"{name}: dtype {t['dtype']}")
        out[name] = v.reshape(t["shape"]).clone()
    return out


class Model:
    def __init__(self, d):
        self.c = json.load(open(os.path.join(d, "config.json")))
        self.w = load_safetensors(os.path.join(d, "model.safetensors"))
        c = self.c
        self.arch = c["architectures"][0]
        self.heads, self.kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
        self.dim = c.get("head_dim") or c["hidden_size"] // self.heads
        self.eps = c.get("rms_norm_eps", 1e-6)
        self.moe = "num_experts_per_tok" in c
        self.qk_norm = self.arch.startswith("Qwen3")
        if c.get("rope_scaling"):
            raise ValueError("rope scaling is not in this reference")
        inv = 1.0 / (c.get("rope_theta", 10000.0) ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim))
        self.inv_freq = inv

    def p(self, name):
        return self.w[name]

    def sparse(self, i):
        c = self.c
        return self.moe and i not in c.get("mlp_only_layers", []) and (i + 1) % c.get("decoder_sparse_step", 1) == 0

    def norm(self, x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def rope(self, x, pos):
        f = pos[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat([f, f], dim=-1)
        cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
        h = x.shape[-1] // 2
        rot = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
        return x * cos + rot * sin

    def linear(self, x, name, bias=False):
        y = x @ self.p(name + ".weight").T
        if bias and name + ".bias" in self.w:
            y = y + self.p(name + ".bias")
        return y

    def attention(self, x, i):
        p = f"model.layers.{i}.self_attn."
        t = x.shape[0]
        q = self.linear(x, p + "q_proj", True).view(t, self.heads, self.dim)
        k = self.linear(x, p + "k_proj", True).view(t, self.kv, self.dim)
        v = self.linear(x, p + "v_proj", True).view(t, self.kv, self.dim)
        if self.qk_norm:
            q, k = self.norm(q, self.p(p + "q_norm.weight")), self.norm(k, self.p(p + "k_norm.weight"))
        pos = torch.arange(t)
        q, k = self.rope(q, pos), self.rope(k, pos)
        rep = self.heads // self.kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) / self.dim**0.5
        s = s.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
        o = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v).reshape(t, -1)
        return self.linear(o, p + "o_proj", True)

    def mlp(self, x, p):
        return self.linear(torch.nn.functional.silu(self.linear(x, p + "gate_proj")) * self.linear(x, p + "up_proj"),
                           p + "down_proj")

    def experts(self, x, i, routes):
        c, p = self.c, f"model.layers.{i}.mlp."
        probs = torch.softmax(self.linear(x, p + "gate"), dim=-1)
        k = c["num_experts_per_tok"]
        top = torch.topk(probs, min(k + 1, probs.shape[-1]), dim=-1)
        w, ids = top.values[:, :k], top.indices[:, :k]
        if c.get("norm_topk_prob", False):
            w = w / w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e in ids.unique():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, w[rows, slot, None] * self.mlp(x[rows], p + f"experts.{int(e)}."))
        if p + "shared_expert_gate.weight" in self.w:
            out = out + torch.sigmoid(self.linear(x, p + "shared_expert_gate")) * self.mlp(x, p + "shared_expert.")
        gaps = top.values[:, :-1] - top.values[:, 1:]
        routes[i] = (ids, gaps.min(-1).values if gaps.shape[1] > 0 else torch.ones(x.shape[0]))
        return out

    @torch.no_grad()
    def forward(self, ids, last=False):
        """Logits of every position (the last alone where last), and each
        sparse layer's choices."""
        h = self.p("model.embed_tokens.weight")[torch.tensor(ids)]
        routes = {}
        for i in range(self.c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = h + self.attention(self.norm(h, self.p(p + "input_layernorm.weight")), i)
            x = self.norm(h, self.p(p + "post_attention_layernorm.weight"))
            h = h + (self.experts(x, i, routes) if self.sparse(i) else self.mlp(x, p + "mlp."))
        h = self.norm(h[-1:] if last else h, self.p("model.norm.weight"))
        head = self.w.get("lm_head.weight", self.p("model.embed_tokens.weight"))
        return h @ head.T, routes


def case(m, prompt):
    logits, _ = m.forward(prompt)
    lp = torch.log_softmax(logits, dim=-1)
    prompt_lp = [float(lp[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    cur, toks, lps, gaps = list(prompt), [], [], []
    for _ in range(NEW_TOKENS):
        logits, _ = m.forward(cur, last=True)
        top = torch.topk(torch.log_softmax(logits[-1], dim=-1), 2)
        toks.append(int(top.indices[0]))
        lps.append(float(top.values[0]))
        gaps.append(float(top.values[0] - top.values[1]))
        cur.append(toks[-1])
    out = {"input_ids": prompt, "output_ids": toks, "output_logprobs": lps, "top2_gap": gaps,
           "prompt_logprobs": prompt_lp}
    if m.moe:
        seq = prompt + toks[:-1]
        _, routes = m.forward(seq)
        layers, k = m.c["num_hidden_layers"], m.c["num_experts_per_tok"]
        out["routed_experts"] = [[[-1] * k for _ in range(layers)] for _ in seq]
        out["router_margin"] = [[1.0] * layers for _ in seq]
        for i, (ids, margin) in routes.items():
            for t in range(len(seq)):
                out["routed_experts"][t][i] = [int(e) for e in ids[t]]
                out["router_margin"][t][i] = float(margin[t])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompts", default="1,7,33", help="prompt lengths")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--input-ids", default="", help="prompts as JSON [[ids...], ...] (instead of random ones)")
    a = ap.parse_args()
    torch.set_num_threads(min(4, os.cpu_count() or 1))
    m = Model(a.model)
    if a.input_ids:
        prompts = json.loads(a.input_ids)
    else:
        rng = random.Random(a.seed)
        vocab = m.c["vocab_size"]
        prompts = [[rng.randrange(vocab) for _ in range(int(n))] for n in a.prompts.split(",")]
    json.dump({"name": os.path.basename(a.model), "new_tokens": NEW_TOKENS, "cases": [case(m, p) for p in prompts]},
              os.sys.stdout)


if __name__ == "__main__":
    main()
