#!/usr/bin/env python3
"""Reads off what the PyTorch on this machine puts on the wire, for ebb's
weight-update paths. GPU machine:

    python3 tools/probe_torch_wire.py --out probe.txt

- The ForkingPickler stream of a CUDA tensor (rebuild_cuda_tensor's
  arguments, the storage handle's format) and of a file_system CPU tensor.
- TCPStore: a trainer thread joins an NCCL group through SGLang's
  init_custom_process_group (rank 0 of 2) and starts a broadcast; this
  process speaks TCPStore's client protocol by hand (validate, add to
  "init/", check) and reports which key holds the NCCL unique id.
- The NCCL versions of torch and of the system library.
"""
import argparse
import glob
import io
import os
import pickletools
import socket
import struct
import threading
import time
from datetime import timedelta
from multiprocessing.reduction import ForkingPickler

import torch
import torch.distributed as dist

from weight_update_trainer import init_custom_process_group  # SGLang's, as verl/slime call it


def u64(n):
    return struct.pack("<Q", n)


def string(s):
    b = s.encode()
    return u64(len(b)) + b


def recv_exact(sock, n):
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise EOFError("closed")
        out += chunk
    return out


def tcpstore_probe(log):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    group = "probe_group"
    err = []

    def trainer():
        try:
            pg = init_custom_process_group("nccl", f"tcp://127.0.0.1:{port}", 2, 0, group, timedelta(seconds=60))
            t = torch.ones(4, device="cuda")
            dist.broadcast(t, src=0, group=pg)
        except Exception as e:  # noqa: BLE001
            err.append(repr(e))

    threading.Thread(target=trainer, daemon=True).start()
    sock = None
    for _ in range(100):
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            break
        except OSError:
            time.sleep(0.05)
    if sock is None:
        log("tcpstore: could not connect")
        return
    sock.sendall(bytes([0]) + struct.pack("<I", 0x3C85F7CE))  # VALIDATE
    sock.sendall(bytes([4]) + string("init/") + struct.pack("<q", 1))  # ADD
    log(f"tcpstore: add init/ -> {struct.unpack('<q', recv_exact(sock, 8))[0]}")
    cands = [f"/{group}/{group}//cuda//0", f"/{group}/{group}//0", f"/{group}//cuda//0", f"/{group}/0",
             f"/{group}/{group}/cuda/0"]
    deadline = time.time() + 20
    found = None
    while time.time() < deadline and not found:
        for k in cands:
            sock.sendall(bytes([5]) + u64(1) + string(k))  # CHECK
            if recv_exact(sock, 1)[0] == 0:
                found = k
                break
        time.sleep(0.1)
    sock.sendall(bytes([7]))  # GETNUMKEYS
    log(f"tcpstore: numkeys {struct.unpack('<q', recv_exact(sock, 8))[0]}; unique id key {found!r}; trainer errors {err}")
    if found:
        sock.sendall(bytes([3]) + string(found))  # GET
        n = struct.unpack("<Q", recv_exact(sock, 8))[0]
        log(f"tcpstore: value of {n} bytes")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="probe.txt")
    args = ap.parse_args()
    f = open(args.out, "w")

    def log(s):
        print(s, flush=True)
        f.write(s + "\n")
        f.flush()

    log(f"torch {torch.__version__}, nccl {torch.cuda.nccl.version()}, device {torch.cuda.get_device_name()}, "
        f"uuid {torch.cuda.get_device_properties(0).uuid}")
    log("system nccl: " + " ".join(sorted(glob.glob("/usr/local/cuda*/lib*/libnccl.so*") + glob.glob("/usr/lib/x86_64-linux-gnu/libnccl.so*"))))
    log("torch nccl: " + " ".join(glob.glob(os.path.join(os.path.dirname(torch.__file__), "..", "nvidia", "nccl", "lib", "*"))))
    t = torch.randn(4, 8, device="cuda").to(torch.bfloat16)
    buf = io.BytesIO()
    ForkingPickler(buf).dump([("w", t[1:])])
    out = io.StringIO()
    pickletools.dis(buf.getvalue(), out=out)
    log("cuda tensor pickle:\n" + out.getvalue())
    share = t.untyped_storage()._share_cuda_()
    log(f"_share_cuda_: device {share[0]!r} handle {len(share[1])} bytes {share[1][:4]!r} size {share[2]} offset {share[3]} "
        f"refcounter {share[4]!r} offset {share[5]} event {len(share[6]) if share[6] else None} sync {share[7]}")
    torch.multiprocessing.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    ForkingPickler(buf).dump(torch.arange(6, dtype=torch.float32))
    out = io.StringIO()
    pickletools.dis(buf.getvalue(), out=out)
    log("cpu tensor pickle (file_system):\n" + out.getvalue())
    try:
        tcpstore_probe(log)
    except Exception as e:  # noqa: BLE001
        log(f"tcpstore probe failed: {e!r}")
    f.close()
    os._exit(0)  # the trainer thread is blocked in NCCL init


if __name__ == "__main__":
    main()
