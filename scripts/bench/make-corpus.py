#!/usr/bin/env python3
"""Writes the realistic load-test corpus: 20,000 texts as JSONL, one
{"text": ...} per line, for `replayd-loadgen --texts`.

Deterministic (random.Random(7), standard library only). For each text,
k = max(3, min(200, int(lognormvariate(3.0, 0.7)))) words are drawn
uniformly (with replacement) from the alphabetic words longer than two
characters in the model's vocab.txt and joined by spaces. Each such word is
one WordPiece token, so a text is k + 2 tokens with [CLS] and [SEP]: mean
about 27, median 22, p99 about 105, max 202 (the shape of the corpus measured
on the H200 in the "Padding-free batching" issue).

    scripts/bench/make-corpus.py /tmp/corpus.jsonl
    scripts/bench/make-corpus.py --vocab models/all-MiniLM-L6-v2/vocab.txt --count 20000 OUT
    scripts/bench/make-corpus.py --mu 3.1 --max-words 254 OUT   # mean ~30 tokens, tail to 256
"""

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

DEFAULT_VOCAB = Path(__file__).resolve().parents[2] / "models/all-MiniLM-L6-v2/vocab.txt"


def words_of(vocab: Path) -> list:
    with open(vocab, encoding="utf-8") as f:
        return [w for w in (line.rstrip("\n") for line in f) if w.isalpha() and len(w) > 2]


def corpus(words: list, count: int, seed: int = 7, mu: float = 3.0, max_words: int = 200):
    rng = random.Random(seed)
    for _ in range(count):
        k = max(3, min(max_words, int(rng.lognormvariate(mu, 0.7))))
        yield " ".join(rng.choice(words) for _ in range(k))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="JSONL file to write")
    p.add_argument("--vocab", type=Path, default=DEFAULT_VOCAB, help="the model's vocab.txt (default: %(default)s)")
    p.add_argument("--count", type=int, default=20000, help="number of texts (default: %(default)s)")
    p.add_argument("--mu", type=float, default=3.0, help="mean of the log of the word count (default: %(default)s; 3.1 gives a mean of about 30 tokens)")
    p.add_argument("--max-words", type=int, default=200, help="longest text in words (default: %(default)s; 254 is a 256-token tail)")
    args = p.parse_args()
    words = words_of(args.vocab)
    if not words:
        print(f"make-corpus: no alphabetic words in {args.vocab}", file=sys.stderr)
        return 1
    tokens = []
    with open(args.out, "w", encoding="utf-8") as f:
        for text in corpus(words, args.count, mu=args.mu, max_words=args.max_words):
            f.write(json.dumps({"text": text}) + "\n")
            tokens.append(text.count(" ") + 1 + 2)
    tokens.sort()
    print(
        f"make-corpus: {len(tokens)} texts from {len(words)} words -> {args.out}; tokens "
        f"mean {statistics.fmean(tokens):.1f}, median {tokens[len(tokens) // 2]}, "
        f"p99 {tokens[int(0.99 * (len(tokens) - 1))]}, max {tokens[-1]}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
