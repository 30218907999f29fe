#!/usr/bin/env python3
"""Embeddings from replayd's HTTP front, the way OpenAI-compatible tools ask.

Start the daemon with the HTTP front on (in its config):

    [http]
    enabled = true
    listen = "127.0.0.1:8080"

then:

    python3 examples/openai_http.py "replay the graph" "pad to the bucket"
    python3 examples/openai_http.py --sdk "..."       # with the OpenAI SDK, if installed

The plain version needs only the standard library (urllib). With --sdk it
uses the OpenAI Python SDK (`pip install openai`), pointed at replayd; the
SDK asks for base64 embeddings by default, which replayd serves.
"""

import argparse
import base64
import json
import math
import struct
import sys
import urllib.error
import urllib.request


def embed_urllib(base_url, model, texts, encoding_format="float"):
    body = json.dumps({"input": texts, "model": model, "encoding_format": encoding_format}).encode()
    req = urllib.request.Request(
        base_url.rstrip("/") + "/v1/embeddings", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            reply = json.load(r)
    except urllib.error.HTTPError as e:
        err = json.load(e)["error"]
        sys.exit(f"HTTP {e.code} {err['code']}: {err['message']}")
    rows = []
    for d in sorted(reply["data"], key=lambda d: d["index"]):
        e = d["embedding"]
        if encoding_format == "base64":
            raw = base64.b64decode(e)
            e = list(struct.unpack(f"<{len(raw) // 4}f", raw))
        rows.append(e)
    return rows, reply["usage"]


def embed_sdk(base_url, model, texts):
    from openai import OpenAI  # pip install openai

    client = OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="replayd-needs-no-key")
    reply = client.embeddings.create(model=model, input=texts)
    return [d.embedding for d in reply.data], reply.usage.model_dump()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("texts", nargs="+")
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--model", default="all-MiniLM-L6-v2")
    p.add_argument("--sdk", action="store_true", help="use the OpenAI Python SDK")
    p.add_argument("--base64", action="store_true", help="ask for base64 (urllib only)")
    a = p.parse_args()
    if a.sdk:
        rows, usage = embed_sdk(a.url, a.model, a.texts)
    else:
        rows, usage = embed_urllib(a.url, a.model, a.texts, "base64" if a.base64 else "float")
    print(f"{len(rows)} embeddings of {len(rows[0])} dimensions; usage {usage}")
    for i, (t, r) in enumerate(zip(a.texts, rows)):
        norm = math.sqrt(sum(x * x for x in r))
        print(f"  [{i}] |e| = {norm:.4f}  {t!r}")
    if len(rows) > 1:
        dot = sum(x * y for x, y in zip(rows[0], rows[1]))
        print(f"cosine(text 0, text 1) = {dot / (math.sqrt(sum(x*x for x in rows[0])) * math.sqrt(sum(y*y for y in rows[1]))):.4f}")


if __name__ == "__main__":
    main()
