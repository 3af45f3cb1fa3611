#!/usr/bin/env python3
"""An RL-style client of ebb's external ZeroMQ API (pyzmq + msgpack).

    python3 rl_client.py --endpoint tcp://127.0.0.1:30001

Every message is a msgpack map with a "type" (SGLang's struct name); every
request carries a "rid" that its reply echoes. This script does what an RL
loop does around rollouts: generate a group of samples per prompt (GRPO),
pause, hand GPU memory to the trainer, take it back, update the weights from
disk and continue. See ioschema/PROTOCOL.md for every message.
"""
import argparse
import sys
import uuid

import msgpack
import zmq


class Client:
    def __init__(self, endpoint, timeout_ms=120000, api_key=None):
        self.api_key = api_key  # the server's --api-key, sent with every message
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.pending = {}  # replies that arrived for other rids

    def send(self, msg_type, **fields):
        rid = fields.pop("rid", None) or uuid.uuid4().hex
        if self.api_key:
            fields["api_key"] = self.api_key
        self.sock.send(msgpack.packb({"type": msg_type, "rid": rid, **fields}))
        return rid

    def recv(self, rid):
        """The next reply for rid (replies to other requests are kept)."""
        if self.pending.get(rid):
            return self.pending[rid].pop(0)
        while True:
            reply = msgpack.unpackb(self.sock.recv(), raw=False)
            if reply.get("rid") == rid:
                return reply
            self.pending.setdefault(reply.get("rid"), []).append(reply)

    def call(self, msg_type, **fields):
        reply = self.recv(self.send(msg_type, **fields))
        if reply["type"] == "ErrorOutput":
            raise RuntimeError(f"{msg_type}: {reply['message']}")
        return reply


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", default="tcp://127.0.0.1:30001")
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--model-path", help="update_weights_from_disk from here (default: skip)")
    ap.add_argument("--api-key", help="the server's --api-key, if it has one")
    args = ap.parse_args()
    c = Client(args.endpoint, api_key=args.api_key)

    # Rollouts: each prompt sampled group-size times (n); the copies share
    # the prompt's KV and come back as rids <rid>-0, <rid>-1, ...
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12]]
    rids = []
    for i, ids in enumerate(prompts):
        c.send("GenerateReqInput", rid=f"p{i}", input_ids=ids, return_logprob=True,
               sampling_params={"max_new_tokens": 8, "temperature": 1.0, "n": args.group_size})
        rids += [f"p{i}-{g}" for g in range(args.group_size)]
    for rid in rids:
        out = c.recv(rid)
        if out["type"] != "GenerateReqOutput":
            raise RuntimeError(out)
        meta = out["meta_info"]
        logprobs = [lp for lp, _, _ in meta["output_token_logprobs"]]
        print(f"{rid}: {len(out['output_ids'])} tokens, sum logprob {sum(logprobs):.3f}, "
              f"cached {meta['cached_tokens']}, finish {meta['finish_reason']['type']}")

    # Training step: give the GPU back, then take it again.
    print(c.call("PauseGenerationReqInput", mode="retract")["message"])
    released = c.call("ReleaseMemoryOccupationReqInput", tags=None)
    print("released:", {t["tag"]: t["bytes"] for t in released["tags"]})
    # ... the trainer runs here ...
    resumed = c.call("ResumeMemoryOccupationReqInput", tags=["weights"])
    print("resumed:", [(t["tag"], t["state"]) for t in resumed["tags"]])
    if args.model_path:
        print(c.call("UpdateWeightFromDiskReqInput", model_path=args.model_path, weight_version="step-1")["message"])
    print(c.call("ResumeMemoryOccupationReqInput", tags=["kv_cache", "cuda_graph"])["message"])
    print(c.call("ContinueGenerationReqInput", torch_empty_cache=True)["message"])

    # Bad input gets an error reply, and the server keeps serving.
    c.sock.send(b"\xc1 not msgpack")
    err = msgpack.unpackb(c.sock.recv(), raw=False)
    print("malformed message ->", err["type"])
    out = c.recv(c.send("GenerateReqInput", input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 2}))
    print("after the bad message:", out["type"], out["meta_info"]["weight_version"])
    return 0 if err["type"] == "ErrorOutput" and out["type"] == "GenerateReqOutput" else 1


if __name__ == "__main__":
    sys.exit(main())
