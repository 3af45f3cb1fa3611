#!/usr/bin/env python3
"""A gpt-fast-style PyTorch decoder for Qwen3 and Qwen3-MoE: the reference
ebb's decode speed is measured against, in the same run. Run on the GPU
machine:

    # ebb's `bench one-batch` and this decoder on one model, one table
    python3 tools/torch_decoder.py --model /tmp/q8b --ebb ebb --batch-size 1,8,64,128,256
    # this decoder alone
    python3 tools/torch_decoder.py --model /tmp/q8b --batch-size 1,64

Each batch size compiles for 85-106 s on the 8B shape (H200, with gpt-fast's
coordinate-descent tuning), so five of them and ebb's run pass the device's
10-minute calls: run --batch-size 1,8,64 and 128,256 in two calls (each ratio
still comes from one run).

The decoder is what gpt-fast builds: a static KV cache per layer, the
attention through scaled_dot_product_attention over the whole cache with a
causal mask (a kv head's query heads as one query's rows, so the cache is
read once and not repeated per head), q/k/v and gate/up as single products, and one decode step
compiled with torch.compile (mode "reduce-overhead": Inductor's fused
element-wise kernels, cuBLAS for the products, the step replayed as one CUDA
graph). MoE layers route with a softmax and top-k (renormalised where the
config says) and run the experts as two grouped products over the tokens
sorted by expert (torch._grouped_mm) or, as gpt-fast's Mixtral does, with
the chosen experts' weights gathered per token: by default the gather for
steps of up to 16 (token, expert) pairs (4-layer Qwen3-30B-A3B shape, H100,
batch 1: 0.607 ms a step against 0.738 grouped), grouped above.

Weights come from the directory's safetensors when it has them (ebb reads the
same files); a directory with config.json alone gets random weights of the
same shapes, and ebb is run with --load-format dummy. Values do not change a
dense model's speed.

Both run B prompts of --input-len random tokens, then --output-len greedy
steps. ebb's figure is its `bench one-batch` median decode step. This
decoder's is the lesser of its median step synchronised each step (as an
engine that reads its tokens) and its mean step run back to back with the
host ahead (gpt-fast's way). The floor is the step's reads at the GPU's
peak bandwidth: every weight once (for MoE the experts that B tokens are
expected to touch, routing uniformly) and the KV of the mean context.
"""
import argparse
import glob
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn


class Config:
    def __init__(self, d):
        self.hidden = d["hidden_size"]
        self.inter = d.get("intermediate_size", 0)
        self.layers = d["num_hidden_layers"]
        self.heads = d["num_attention_heads"]
        self.kv_heads = d.get("num_key_value_heads", self.heads)
        self.head_dim = d.get("head_dim") or self.hidden // self.heads
        self.vocab = d["vocab_size"]
        self.eps = d.get("rms_norm_eps", 1e-6)
        self.theta = d.get("rope_theta", 1e6)
        self.tied = d.get("tie_word_embeddings", False)
        self.experts = d.get("num_experts") or d.get("num_local_experts", 0)  # Qwen's spelling, transformers 5's
        self.top_k = d.get("num_experts_per_tok", 0)
        self.moe_inter = d.get("moe_intermediate_size", 0)
        self.norm_topk = d.get("norm_topk_prob", False)
        self.sparse_step = d.get("decoder_sparse_step", 1)
        self.mlp_only = set(d.get("mlp_only_layers", []))

    def sparse(self, i):
        """Qwen3-MoE's rule for which layers have experts."""
        return self.experts > 0 and i not in self.mlp_only and (i + 1) % self.sparse_step == 0


def rms_norm(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.wqkv = nn.Linear(c.hidden, (c.heads + 2 * c.kv_heads) * c.head_dim, bias=False)
        self.wo = nn.Linear(c.heads * c.head_dim, c.hidden, bias=False)
        self.q_norm = nn.Parameter(torch.ones(c.head_dim))
        self.k_norm = nn.Parameter(torch.ones(c.head_dim))
        # Buffers, so that torch.compile treats them as static: a CUDA graph
        # may write into them.
        self.register_buffer("k_cache", None, persistent=False)
        self.register_buffer("v_cache", None, persistent=False)

    def forward(self, x, cos, sin, mask, pos):
        c, (b, t, _) = self.c, x.shape
        q, k, v = self.wqkv(x).split([c.heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim], -1)
        q = rms_norm(q.view(b, t, c.heads, c.head_dim), self.q_norm, c.eps)
        k = rms_norm(k.view(b, t, c.kv_heads, c.head_dim), self.k_norm, c.eps)
        v = v.view(b, t, c.kv_heads, c.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        # The query heads of a kv head as rows of one query (gpt-fast
        # repeats the cache per query head instead, which copies all of it
        # every step).
        rep = c.heads // c.kv_heads
        q = q.reshape(b, c.kv_heads, rep * t, c.head_dim)
        y = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask.repeat(1, 1, rep, 1))
        return self.wo(y.view(b, c.heads, t, c.head_dim).transpose(1, 2).reshape(b, t, c.heads * c.head_dim))


class DenseMLP(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.w13 = nn.Linear(hidden, 2 * inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        g, u = self.w13(x).chunk(2, dim=-1)
        return self.w2(F.silu(g) * u)


class SparseMLP(nn.Module):
    def __init__(self, c, path):
        super().__init__()
        self.c, self.path = c, path
        self.gate = nn.Linear(c.hidden, c.experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(c.experts, 2 * c.moe_inter, c.hidden))
        self.w2 = nn.Parameter(torch.empty(c.experts, c.hidden, c.moe_inter))

    def forward(self, x):
        shape, c = x.shape, self.c
        x = x.reshape(-1, c.hidden)
        probs = self.gate(x).float().softmax(-1)
        w, idx = probs.topk(c.top_k, dim=-1)
        if c.norm_topk:
            w = w / w.sum(-1, keepdim=True)
        w = w.to(x.dtype)
        if self.path == "gather" or (self.path == "auto" and x.shape[0] * c.top_k <= 16):
            g, u = torch.einsum("nh,nkoh->nko", x, self.w13[idx]).chunk(2, dim=-1)
            y = torch.einsum("nki,nkhi->nkh", F.silu(g) * u, self.w2[idx])
            return (y * w[..., None]).sum(1).view(shape)
        flat = idx.flatten()
        order = flat.argsort(stable=True)
        tok = order // c.top_k
        counts = torch.zeros(c.experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)
        g, u = torch._grouped_mm(x[tok], self.w13.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(g) * u, self.w2.transpose(-2, -1), offs=offs)
        y = y * w.flatten()[order][:, None]
        return torch.zeros_like(x).index_add_(0, tok, y).view(shape)


class Block(nn.Module):
    def __init__(self, c, i, moe_path):
        super().__init__()
        self.eps = c.eps
        self.attn = Attention(c)
        self.mlp = SparseMLP(c, moe_path) if c.sparse(i) else DenseMLP(c.hidden, c.inter)
        self.ln1 = nn.Parameter(torch.ones(c.hidden))
        self.ln2 = nn.Parameter(torch.ones(c.hidden))

    def forward(self, x, cos, sin, mask, pos):
        h = x + self.attn(rms_norm(x, self.ln1, self.eps), cos, sin, mask, pos)
        return h + self.mlp(rms_norm(h, self.ln2, self.eps))


class Decoder(nn.Module):
    def __init__(self, c, moe_path):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c.vocab, c.hidden)
        self.blocks = nn.ModuleList(Block(c, i, moe_path) for i in range(c.layers))
        self.norm = nn.Parameter(torch.ones(c.hidden))
        self.lm_head = None if c.tied else nn.Linear(c.hidden, c.vocab, bias=False)

    def setup_caches(self, batch, seq):
        c = self.c
        dev, dt = self.embed.weight.device, self.embed.weight.dtype
        for b in self.blocks:
            b.attn.k_cache = b.attn.v_cache = None
        torch.cuda.empty_cache()
        for b in self.blocks:
            b.attn.k_cache = torch.zeros(batch, c.kv_heads, seq, c.head_dim, device=dev, dtype=dt)
            b.attn.v_cache = torch.zeros_like(b.attn.k_cache)
        inv = 1.0 / (c.theta ** (torch.arange(0, c.head_dim, 2, device=dev, dtype=torch.float32) / c.head_dim))
        f = torch.outer(torch.arange(seq, device=dev, dtype=torch.float32), inv)
        f = torch.cat((f, f), dim=-1)
        self.cos, self.sin = f.cos().to(dt), f.sin().to(dt)
        self.causal = torch.ones(seq, seq, dtype=torch.bool, device=dev).tril()

    def forward(self, tokens, pos):
        x = self.embed(tokens)
        cos, sin = self.cos[pos][None, :, None, :], self.sin[pos][None, :, None, :]
        mask = self.causal[None, None, pos]
        for b in self.blocks:
            x = b(x, cos, sin, mask, pos)
        x = rms_norm(x[:, -1:], self.norm, self.c.eps)  # the last position's logits only
        return F.linear(x, self.embed.weight if self.lm_head is None else self.lm_head.weight)


def hf_names(c, i, fused):
    """Our parameters of layer i and the checkpoint tensors each is made of
    (concatenated along dim 0, or stacked over experts)."""
    p = f"model.layers.{i}."
    m = {
        f"blocks.{i}.attn.wqkv.weight": [p + f"self_attn.{n}_proj.weight" for n in "qkv"],
        f"blocks.{i}.attn.wo.weight": [p + "self_attn.o_proj.weight"],
        f"blocks.{i}.attn.q_norm": [p + "self_attn.q_norm.weight"],
        f"blocks.{i}.attn.k_norm": [p + "self_attn.k_norm.weight"],
        f"blocks.{i}.ln1": [p + "input_layernorm.weight"],
        f"blocks.{i}.ln2": [p + "post_attention_layernorm.weight"],
    }
    if c.sparse(i):
        m[f"blocks.{i}.mlp.gate.weight"] = [p + "mlp.gate.weight"]
        if fused:  # transformers 5 writes a layer's experts as two tensors
            m[f"blocks.{i}.mlp.w13"] = [p + "mlp.experts.gate_up_proj"]
            m[f"blocks.{i}.mlp.w2"] = [p + "mlp.experts.down_proj"]
        else:
            m[f"blocks.{i}.mlp.w13"] = [[p + f"mlp.experts.{e}.gate_proj.weight", p + f"mlp.experts.{e}.up_proj.weight"]
                                        for e in range(c.experts)]
            m[f"blocks.{i}.mlp.w2"] = [[p + f"mlp.experts.{e}.down_proj.weight"] for e in range(c.experts)]
    else:
        m[f"blocks.{i}.mlp.w13.weight"] = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        m[f"blocks.{i}.mlp.w2.weight"] = [p + "mlp.down_proj.weight"]
    return m


@torch.no_grad()
def load(model, c, model_dir):
    """Fills the model from the directory's safetensors; returns False when
    it has none (the weights are then random)."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    params = dict(model.named_parameters())
    if not files:
        for name, p in params.items():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
        return False
    from safetensors.torch import load_file
    tensors = {}
    for f in files:
        tensors.update(load_file(f, device="cuda"))
    names = {"embed.weight": ["model.embed_tokens.weight"], "norm": ["model.norm.weight"]}
    if not c.tied:
        names["lm_head.weight"] = ["lm_head.weight"]
    fused = any(n.endswith("mlp.experts.gate_up_proj") for n in tensors)
    for i in range(c.layers):
        names.update(hf_names(c, i, fused))
    for ours, theirs in names.items():
        if isinstance(theirs[0], list):  # experts, stacked
            t = torch.stack([torch.cat([tensors.pop(n) for n in e]) for e in theirs])
        else:
            t = torch.cat([tensors.pop(n) for n in theirs])
        params[ours].copy_(t.view(params[ours].shape))
    return True


def peak_bandwidth():
    """Bytes/s from the memory clock and bus width, as NVML gives them."""
    p = torch.cuda.get_device_properties(0)
    clock, bus = getattr(p, "memory_clock_rate", 0), getattr(p, "memory_bus_width", 0)
    if clock and bus:
        return clock * 1e3 * bus / 8 * 2
    return 4.8e12 if "H200" in p.name else 3.35e12


def floor_ms(c, batch, ctx, bw):
    """The decode step's reads at peak bandwidth, in ms."""
    attn = c.hidden * (c.heads + 2 * c.kv_heads) * c.head_dim + c.heads * c.head_dim * c.hidden
    weights = c.vocab * c.hidden
    for i in range(c.layers):
        weights += attn
        if c.sparse(i):
            touched = c.experts * (1 - (1 - c.top_k / c.experts) ** batch)
            weights += c.hidden * c.experts + touched * 3 * c.hidden * c.moe_inter
        else:
            weights += 3 * c.hidden * c.inter
    kv = batch * ctx * c.layers * 2 * c.kv_heads * c.head_dim
    return (weights + kv) * 2 / bw * 1e3


@torch.no_grad()
def check(model, c, model_dir):
    """This decoder's logits against transformers' (bf16, sdpa) on the same
    files: a reference that computed something else would time something
    else."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device_map="cuda")
    prompt = torch.randint(0, c.vocab, (2, 64), device="cuda")
    theirs = torch.log_softmax(hf(prompt).logits[:, -1].float(), dim=-1)
    del hf
    torch.cuda.empty_cache()
    model.setup_caches(2, 64)
    ours = torch.log_softmax(model(prompt, torch.arange(64, device="cuda"))[:, -1].float(), dim=-1)
    d = (ours - theirs).abs()
    same = bool((ours.argmax(-1) == theirs.argmax(-1)).all())
    print(f"check against transformers: mean |dlogprob| {d.mean():.4f}, max {d.max():.3f}, same argmax: {same}",
          flush=True)
    if d.mean() > 0.2:  # bf16 noise is about 0.05 (eager against sdpa attention)
        raise SystemExit("this decoder does not compute what transformers computes")


def run_ebb(args, dummy):
    cmd = [args.ebb, "bench", "one-batch", "--model", args.model, "--batch-size", args.batch_size,
           "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--json"]
    if dummy:
        cmd += ["--load-format", "dummy"]
    cmd += args.ebb_arg
    print("+", " ".join(cmd), flush=True)
    out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
    return {r["batch_size"]: r for r in json.loads(out)}


@torch.no_grad()
def bench_batch(model, c, step, batch, args):
    seq = args.input_len + args.output_len
    model.setup_caches(batch, seq)
    torch._dynamo.reset()
    fn = torch.compile(step, mode="reduce-overhead", fullgraph=True, dynamic=False) if args.compile else step
    prompt = torch.randint(0, c.vocab, (batch, args.input_len), device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    tok = model(prompt, torch.arange(args.input_len, device="cuda")).argmax(-1)
    torch.cuda.synchronize()
    prefill = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    for p in range(args.input_len, args.input_len + 4):  # compile, record the graph
        fn(tok, torch.tensor([p], device="cuda"))
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    times = []
    cur = tok
    for p in range(args.input_len, seq):
        pos = torch.tensor([p], device="cuda")
        t0 = time.perf_counter()
        cur = fn(cur, pos).clone()
        cur.cpu()  # as an engine that reads its tokens every step
        times.append((time.perf_counter() - t0) * 1e3)
    # As gpt-fast times it: the steps back to back, the host running ahead.
    pos = torch.tensor([args.input_len], device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.output_len):
        cur = fn(cur, pos).clone()
        pos += 1
    torch.cuda.synchronize()
    unsynced = (time.perf_counter() - t0) * 1e3 / args.output_len
    return dict(batch_size=batch, prefill_ms=prefill, decode_step_median_ms=statistics.median(times),
                decode_step_unsynced_ms=unsynced, compile_s=compile_s,
                decode_ms=min(unsynced, statistics.median(times)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a Hugging Face model directory (config.json; safetensors optional)")
    ap.add_argument("--batch-size", default="1,8,64,128,256")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--ebb", help="also run `EBB bench one-batch` on the same model first, and compare")
    ap.add_argument("--ebb-arg", action="append", default=[], help="an extra argument for ebb (repeatable)")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="eager steps (for debugging)")
    ap.add_argument("--moe-path", choices=("auto", "grouped", "gather"), default="auto",
                    help="auto: gather for up to 16 (token, expert) pairs a step, grouped products above")
    ap.add_argument("--check", action="store_true", help="compare the logits with transformers' first (needs safetensors)")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args()

    with open(os.path.join(args.model, "config.json")) as f:
        c = Config(json.load(f))
    dummy = not glob.glob(os.path.join(args.model, "*.safetensors"))
    ebb = run_ebb(args, dummy) if args.ebb else {}

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = Decoder(c, args.moe_path)
    torch.set_default_dtype(torch.float32)
    model.requires_grad_(False)
    print("weights:", "random (config.json only)" if not load(model, c, args.model) else "safetensors", flush=True)
    if args.check:
        check(model, c, args.model)
    import torch._inductor.config as ic
    ic.coordinate_descent_tuning = True
    ic.triton.unique_kernel_names = True
    torch._dynamo.config.cache_size_limit = 64

    def step(tok, pos):
        return model(tok, pos).argmax(-1)

    bw = peak_bandwidth()
    ctx = args.input_len + args.output_len / 2
    rows = []
    for b in [int(x) for x in args.batch_size.split(",")]:
        r = bench_batch(model, c, step, b, args)
        r["floor_ms"] = floor_ms(c, b, ctx, bw)
        if b in ebb:
            r["ebb_decode_step_median_ms"] = ebb[b]["decode_step_median_ms"]
            r["ebb_prefill_ms"] = ebb[b]["prefill_ms"]
        rows.append(r)
        print(json.dumps(r), flush=True)

    print(f"\n{torch.cuda.get_device_name()}, peak {bw / 1e12:.2f} TB/s, {args.input_len} in / {args.output_len} out, "
          f"decode ms a step (median)")
    print("| batch | floor | PyTorch compiled | ebb | ebb / PyTorch | ebb share of floor |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        e = r.get("ebb_decode_step_median_ms")
        cells = [r["batch_size"], f"{r['floor_ms']:.2f}", f"{r['decode_ms']:.3f}"]
        cells += [f"{e:.3f}", f"{e / r['decode_ms']:.3f}", f"{100 * r['floor_ms'] / e:.0f} %"] if e else ["", "", ""]
        print("| " + " | ".join(str(x) for x in cells) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), peak_bytes_per_s=bw, rows=rows), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
