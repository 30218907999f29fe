#!/usr/bin/env python3
"""Embed a file of sentences (one per line) with replayd and print the throughput.

    python examples/embed_file.py sentences.txt
    python examples/embed_file.py sentences.txt -e tcp://10.0.0.5:5555 -e tcp://10.0.0.6:5555 -o emb.npy
    cut -f2 data.tsv | python examples/embed_file.py -

Every batch of --batch-size lines is one request; all of them are in flight at
once (pipelined over one socket per daemon), and the rows come back in file
order.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from replayd import Client, ReplaydError


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="text file, one sentence per line ('-' for stdin)")
    p.add_argument("-e", "--endpoint", action="append", help="daemon endpoint (repeat for several; default tcp://127.0.0.1:5555)")
    p.add_argument("-m", "--model", default="all-MiniLM-L6-v2")
    p.add_argument("-b", "--batch-size", type=int, default=32, help="texts per request (default 32)")
    p.add_argument("-o", "--output", help="save the embeddings here (.npy)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole file (default 600)")
    p.add_argument("--keep-empty", action="store_true", help="embed empty lines too (default: skip them)")
    args = p.parse_args()

    f = sys.stdin if args.path == "-" else open(args.path, encoding="utf-8")
    with f:
        lines = [line.rstrip("\n") for line in f]
    if not args.keep_empty:
        lines = [line for line in lines if line.strip()]
    if not lines:
        print("no sentences", file=sys.stderr)
        return 1

    endpoints = args.endpoint or ["tcp://127.0.0.1:5555"]
    with Client(endpoints, model=args.model, timeout=args.timeout) as client:
        if not client.wait_connected(10):
            print(f"no daemon answering at {endpoints}", file=sys.stderr)
            return 1
        client.embed(lines[:1])  # a warm-up request, not timed
        t0 = time.perf_counter()
        try:
            emb = client.embed(lines, batch_size=args.batch_size)
        except ReplaydError as e:
            print(f"failed: {e}", file=sys.stderr)
            return 1
        dt = time.perf_counter() - t0
        stats = client.stats()

    chars = sum(len(s) for s in lines)
    print(f"{len(lines)} sentences ({chars} characters) -> {emb.shape[0]} x {emb.shape[1]} {emb.dtype}")
    print(f"{dt:.3f} s: {len(lines) / dt:,.0f} sentences/s, {dt / len(lines) * 1e6:,.0f} us each")
    for s in stats:
        print(f"  {s['endpoint']}: {s['replies']} replies, {s['resent']} re-sent, {s['lost']} lost with the connection")
    if args.output:
        np.save(args.output, emb)
        print(f"saved {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
