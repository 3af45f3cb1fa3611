#!/usr/bin/env python3
"""Collects the training text of ebb's default model from a Go installation.

    python3 tools/make_go_corpus.py --goroot /usr/local/go --out .device/corpus.jsonl.xz

The corpus is Go's own source tree (non-test .go files outside testdata and
vendor) and its documentation (doc/*.html, doc/*.md), which the Go Authors
publish under a BSD-3-Clause licence (GOROOT/LICENSE, copied next to the model
as LICENSE.corpus). Each line of the output is one document as JSON:
{"path": ..., "text": ...}. Files are ordered by path so the split between
training and validation (by hash of the path) is the same everywhere.
"""
import argparse
import hashlib
import json
import lzma
import os


def documents(goroot):
    src = os.path.join(goroot, "src")
    for root, dirs, files in os.walk(src):
        dirs[:] = sorted(d for d in dirs if d not in ("testdata", "vendor"))
        for f in sorted(files):
            if f.endswith(".go") and not f.endswith("_test.go"):
                yield os.path.join(root, f)
    doc = os.path.join(goroot, "doc")
    for f in sorted(os.listdir(doc)):
        if f.endswith((".html", ".md")):
            yield os.path.join(doc, f)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--goroot", default="/usr/local/go")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-bytes", type=int, default=64 << 20, help="stop after this much text")
    args = ap.parse_args()
    total, n = 0, 0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with lzma.open(args.out, "wt", encoding="utf-8", preset=6) as out:
        for path in documents(args.goroot):
            try:
                text = open(path, encoding="utf-8").read()
            except UnicodeDecodeError:
                continue
            if not text.strip() or len(text) > 400_000:  # generated tables teach little
                continue
            rel = os.path.relpath(path, args.goroot)
            out.write(json.dumps({"path": rel, "text": text}) + "\n")
            total += len(text.encode())
            n += 1
            if total >= args.max_bytes:
                break
    digest = hashlib.sha256(open(args.out, "rb").read()).hexdigest()[:16]
    print(f"{n} documents, {total / 1e6:.1f} MB of text -> {args.out} (sha256 {digest})")


if __name__ == "__main__":
    main()
