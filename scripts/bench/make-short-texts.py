#!/usr/bin/env python3
"""Writes issue 10's target-1 texts: 2,000 texts of 10-14 vocabulary words as
JSONL ({"text": ...} per line), 12-16 tokens with [CLS] and [SEP] (each
alphabetic vocabulary word longer than two characters is one WordPiece
token). Deterministic (random.Random(11)).

    scripts/bench/make-short-texts.py VOCAB.txt OUT.jsonl
"""
import json
import random
import sys

words = [w for w in (l.rstrip("\n") for l in open(sys.argv[1], encoding="utf-8")) if w.isalpha() and len(w) > 2]
rng = random.Random(11)
with open(sys.argv[2], "w") as f:
    for _ in range(2000):
        f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(10, 14)))}) + "\n")
