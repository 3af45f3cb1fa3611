#!/usr/bin/env python3
"""A trainer stand-in that updates a running ebb (or SGLang) server's
weights the way verl, slime and AReaL do, in plain PyTorch (no SGLang
import):

  --transport ipc   CUDA tensors, update_weights_from_tensor (verl colocated,
                    slime): ForkingPickler + base64, one payload per TP rank
  --transport shm   CPU tensors shared with torch's file_system strategy, the
                    same request (ebb's CPU backend; CI runs this one)
  --transport nccl  init_weights_update_group + update_weights_from_distributed
                    with one torch.distributed.broadcast per tensor (slime,
                    AReaL); the trainer is rank 0

  --format list       [(name, tensor), ...]
  --format flattened  SGLang's flattened_bucket: one tensor per bucket plus
                      FlattenedTensorMetadata entries (pickled under SGLang's
                      module path, as senders that import SGLang produce)
  --format local      [(name, LocalSerializedTensor([per-rank pickles]))], verl's form

The weights come from a safetensors checkpoint (--model) and are sent in
buckets of --bucket-mb. With --dummy they are random instead, made where
they are sent from (the GPU for ipc and nccl), with the names and shapes
that transformers gives the model of --model's config.json (transformers
is imported for this only): a server on --load-format dummy can then take
a model too large for the disk. With --repeat N the update runs N times;
the report (JSON on stdout, or --report) has the time of each update, for
ipc the trainer's reserved CUDA memory after torch.cuda.ipc_collect(), and
under "probe" the first 64 values of a few tensors, for checking against
the server's /get_weights_by_name.
"""
import argparse
import base64
import io
import json
import os
import struct
import sys
import threading
import time
import types
import urllib.request
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing


# ---- what the senders pickle, under SGLang's names -------------------------

@dataclass
class FlattenedTensorMetadata:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


@dataclass
class LocalSerializedTensor:
    values: list


def _register(module, cls):
    """Makes cls picklable as module.cls (the pickler imports the module
    path to check it): the module and its parents exist in sys.modules."""
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            sys.modules[name] = types.ModuleType(name)
            if i > 1:
                setattr(sys.modules[".".join(parts[:i - 1])], parts[i - 1], sys.modules[name])
    setattr(sys.modules[module], cls.__name__, cls)
    cls.__module__ = module
    cls.__qualname__ = cls.__name__


_register("sglang.srt.weight_sync.tensor_bucket", FlattenedTensorMetadata)
_register("sglang.srt.model_executor.model_runner", LocalSerializedTensor)


def serialize(obj):
    """SGLang's MultiprocessingSerializer.serialize(obj, output_str=True)."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode()


def flatten(named):
    """SGLang's FlattenedTensorBucket: one flat tensor and its metadata."""
    metas, flat, idx = [], [], 0
    for name, t in named:
        n = t.numel()
        metas.append(FlattenedTensorMetadata(name, t.shape, t.dtype, idx, idx + n, n))
        flat.append(t.flatten())
        idx += n
    return {"flattened_tensor": torch.cat(flat), "metadata": metas}


# ---- the checkpoint ---------------------------------------------------------

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def read_safetensors(path):
    """A small reader (the safetensors package is not everywhere)."""
    files = [os.path.join(path, f) for f in sorted(os.listdir(path)) if f.endswith(".safetensors")]
    out = {}
    for f in files:
        data = open(f, "rb").read()
        n = struct.unpack("<Q", data[:8])[0]
        header = json.loads(data[8:8 + n])
        base = 8 + n
        for name, info in header.items():
            if name == "__metadata__":
                continue
            a, b = info["data_offsets"]
            raw = bytearray(data[base + a:base + b])
            t = torch.frombuffer(raw, dtype=torch.uint8).view(DTYPES[info["dtype"]]).reshape(info["shape"])
            out[name] = t
    return out


def dummy_weights(path, device, seed=0):
    """Random weights named and shaped as transformers' model of path's
    config.json (built on the meta device, so it holds no memory), scaled
    like an initialised model's, in the config's dtype."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    dtype = getattr(torch, str(getattr(cfg, "torch_dtype", None) or getattr(cfg, "dtype", None) or "bfloat16").replace("torch.", ""))
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():  # tied weights once, as trainers send them
        t = torch.empty(p.shape, dtype=dtype, device=device)
        out[name] = t.normal_(0.0, 0.02, generator=gen) if p.dim() > 1 else t.fill_(1.0)
    return out


def probe(weights, n=64):
    """The first n values of a few tensors (the first, the last, and the
    first of the experts' where there are experts), flattened as
    /get_weights_by_name returns them."""
    names = list(weights)
    picks = [names[0], names[-1]] + [k for k in names if ".mlp.experts." in k][:1]
    return {k: weights[k].flatten()[:n].float().tolist() for k in dict.fromkeys(picks)}


def buckets(named, bucket_bytes):
    cur, size = [], 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > bucket_bytes:
            yield cur
            cur, size = [], 0
        cur.append((name, t))
        size += nbytes
    if cur:
        yield cur


def post(url, path, body, timeout=600):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


# ---- transports -------------------------------------------------------------

def send_tensors(args, named, version):
    """update_weights_from_tensor, one request per bucket, one payload per
    tensor-parallel rank. CUDA tensors go to rank r from a copy on GPU r, as
    a colocated trainer's rank r shares its own."""
    per_rank = [named] * args.tp_size
    if args.transport == "ipc":
        per_rank = [named] + [[(k, v.to(f"cuda:{r}")) for k, v in named] for r in range(1, args.tp_size)]
        torch.cuda.synchronize()
    results = []
    for rank_buckets in zip(*[buckets(n, args.bucket_mb << 20) for n in per_rank]):
        payloads, load_format = [], None
        if args.format == "local":  # verl's: each rank's own entry inside one payload, sent to every rank
            bucket = rank_buckets[0]
            payloads = [serialize([(n, LocalSerializedTensor([base64.b64decode(serialize(t))] * args.tp_size))
                                   for n, t in bucket])] * args.tp_size
        for bucket in rank_buckets if not payloads else []:
            if args.format == "flattened":
                payload, load_format = flatten(bucket), "flattened_bucket"
            else:
                payload = bucket
            payloads.append(serialize(payload))
        body = {"serialized_named_tensors": payloads, "load_format": load_format, "flush_cache": True,
                "weight_version": version}
        status, out = post(args.url, "/update_weights_from_tensor", body)
        results.append((status, out))
        if status != 200 or not out.get("success"):
            raise SystemExit(f"update_weights_from_tensor: {status} {out}")
    return results


def init_custom_process_group(backend, init_method, world_size, rank, group_name, timeout):
    """SGLang's init_custom_process_group, which verl, slime and AReaL copy."""
    import inspect

    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    params = inspect.signature(_new_process_group_helper).parameters
    opt = "backend_options" if "backend_options" in params else "pg_options"
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                      **{opt: None}, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def init_nccl(args):
    group = "weight_update_group"
    reply = {}

    def ask():
        reply["r"] = post(args.url, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": args.master_port,
                                                                   "rank_offset": 1, "world_size": 1 + args.tp_size, "group_name": group,
                                                                   "backend": "nccl"})
    th = threading.Thread(target=ask)
    th.start()
    pg = init_custom_process_group("nccl", f"tcp://127.0.0.1:{args.master_port}", 1 + args.tp_size, 0, group,
                                   timedelta(seconds=120))
    th.join()
    status, out = reply["r"]
    if status != 200 or not out.get("success"):
        raise SystemExit(f"init_weights_update_group: {status} {out}")
    return pg


def send_nccl(args, pg, named, version, kill_after=None):
    import torch.distributed as dist
    for bucket in buckets(named, args.bucket_mb << 20):
        names = [n for n, _ in bucket]
        body = {"names": names, "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket], "group_name": "weight_update_group",
                "flush_cache": True, "weight_version": version}
        if args.format == "flattened":
            body["load_format"] = "flattened_bucket"
        reply = {}
        th = threading.Thread(target=lambda: reply.setdefault("r", post(args.url, "/update_weights_from_distributed", body)))
        th.start()
        if args.format == "flattened":
            dist.broadcast(flatten(bucket)["flattened_tensor"], src=0, group=pg)
        else:
            for i, (_, t) in enumerate(bucket):
                if kill_after is not None and i == kill_after:
                    torch.cuda.synchronize()
                    print(json.dumps({"killed_after": i}), flush=True)
                    os._exit(3)  # a trainer that dies mid-update
                dist.broadcast(t, src=0, group=pg)
        torch.cuda.synchronize()
        th.join()
        status, out = reply["r"]
        if status != 200 or not out.get("success"):
            raise SystemExit(f"update_weights_from_distributed: {status} {out}")


def shm_refcounts(named):
    """The reference counts in the headers of the shared files: 1 (our own
    mapping) once the server has given back what each payload carried."""
    counts = set()
    for _, t in named:
        storage = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage().untyped()  # torch < 2
        handle = storage._share_filename_cpu_()[1].decode()
        with open("/dev/shm" + handle, "rb") as f:
            counts.add(struct.unpack("<i", f.read(4))[0])
    return sorted(counts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True, help="safetensors directory whose weights are sent (with --dummy: its config.json)")
    ap.add_argument("--dummy", action="store_true", help="send random weights shaped by --model's config.json")
    ap.add_argument("--transport", choices=["ipc", "shm", "nccl"], required=True)
    ap.add_argument("--format", choices=["list", "flattened", "local"], default="list")
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--dtype", default="", help="cast the weights first (e.g. float32)")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--master-port", type=int, default=29555)
    ap.add_argument("--kill-after", type=int, default=None, help="nccl: die after this many tensors of the first bucket")
    ap.add_argument("--report", default="")
    args = ap.parse_args()
    if args.dummy:
        weights = dummy_weights(args.model, "cpu" if args.transport == "shm" else "cuda")
    else:
        weights = read_safetensors(args.model)
    if args.dtype:
        weights = {k: v.to(getattr(torch, args.dtype)) for k, v in weights.items()}
    report = {"transport": args.transport, "format": args.format, "bucket_mb": args.bucket_mb,
              "bytes": sum(t.numel() * t.element_size() for t in weights.values()), "updates_ms": [],
              "probe": probe(weights)}
    if args.transport == "shm":
        torch.multiprocessing.set_sharing_strategy("file_system")
        named = [(k, v.contiguous().share_memory_()) for k, v in weights.items()]
    else:
        named = [(k, v.contiguous().cuda()) for k, v in weights.items()]
        torch.cuda.synchronize()
    pg = init_nccl(args) if args.transport == "nccl" else None
    for i in range(args.repeat):
        t0 = time.perf_counter()
        if pg is not None:
            send_nccl(args, pg, named, f"nccl-{i}", args.kill_after if i == 0 else None)
        else:
            send_tensors(args, named, f"{args.transport}-{i}")
        report["updates_ms"].append((time.perf_counter() - t0) * 1000)
        if args.transport == "ipc":
            torch.cuda.ipc_collect()
            report.setdefault("trainer_reserved_bytes", []).append(torch.cuda.memory_reserved())
        if args.transport == "shm":
            report["shm_refcounts"] = shm_refcounts(named)
    if pg is not None:
        status, out = post(args.url, "/destroy_weights_update_group", {"group_name": "weight_update_group"}, timeout=60)
        if status != 200 or not out.get("success"):
            raise SystemExit(f"destroy_weights_update_group: {status} {out}")
    ms = sorted(report["updates_ms"])
    report["median_ms"] = ms[len(ms) // 2]
    report["gb_per_s"] = report["bytes"] / (report["median_ms"] / 1000) / 1e9
    out = json.dumps(report)
    if args.report:
        open(args.report, "w").write(out)
    print(out, flush=True)


if __name__ == "__main__":
    main()
