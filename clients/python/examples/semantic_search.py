#!/usr/bin/env python3
"""Semantic search over a small corpus with replayd embeddings.

    python examples/semantic_search.py "How do I get a refund?"
    python examples/semantic_search.py --corpus faq.txt --top 3 "reset my password" "opening hours"
    python examples/semantic_search.py --corpus faq.txt          # interactive: one query per line

The corpus is embedded once (pipelined requests), queries one call each.
all-MiniLM-L6-v2 returns L2-normalised embeddings, so the dot product is the
cosine similarity.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from replayd import Client

CORPUS = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "A cheetah is running behind its prey.",
    "Refunds are issued to the original payment method within five working days.",
    "You can reset your password from the sign-in page.",
    "The shop is open from 9 am to 6 pm, Monday to Saturday.",
]


def search(client: Client, corpus_emb: np.ndarray, corpus: list, query: str, top: int):
    q = client.encode(query, normalize_embeddings=True)  # 1-D, like sentence-transformers
    scores = corpus_emb @ q
    best = np.argsort(-scores)[:top]
    return [(float(scores[i]), corpus[i]) for i in best]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("queries", nargs="*")
    p.add_argument("--corpus", help="text file, one document per line (default: a built-in sample)")
    p.add_argument("-e", "--endpoint", action="append", help="daemon endpoint (repeatable; default tcp://127.0.0.1:5555)")
    p.add_argument("-m", "--model", default="all-MiniLM-L6-v2")
    p.add_argument("--top", type=int, default=5)
    args = p.parse_args()

    if args.corpus:
        with open(args.corpus, encoding="utf-8") as f:
            corpus = [line.strip() for line in f if line.strip()]
    else:
        corpus = CORPUS
    with Client(args.endpoint or ["tcp://127.0.0.1:5555"], model=args.model, timeout=120) as client:
        corpus_emb = client.encode(corpus, normalize_embeddings=True)
        queries = args.queries or (line.strip() for line in sys.stdin)
        for query in queries:
            if not query:
                continue
            print(f"\n{query}")
            for score, doc in search(client, corpus_emb, corpus, query, args.top):
                print(f"  {score:.4f}  {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
