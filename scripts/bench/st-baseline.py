#!/usr/bin/env python3
"""sentence-transformers' encode() throughput on a corpus, for scripts/bench/bench-host.sh.

Loads MODEL_DIR with sentence-transformers in f16 and in f32 on the GPU,
warms each up, then times encode(texts, batch_size=512) over the whole
corpus (a JSONL of {"text": ...}, e.g. from scripts/bench/make-corpus.py) and
writes {"f16_texts_per_s", "f32_texts_per_s", "best_texts_per_s",
"best_dtype", ...} to OUT_JSON. The faster of the two is the baseline the
bench's throughput targets are ratios of.

Usage: st-baseline.py MODEL_DIR CORPUS_JSONL OUT_JSON [SECONDS_BUDGET]
"""
import json
import sys
import time
import traceback

model_dir, corpus_path, out_path = sys.argv[1:4]
budget = float(sys.argv[4]) if len(sys.argv) > 4 else 120.0
t_start = time.perf_counter()
texts = [json.loads(line)["text"] for line in open(corpus_path) if line.strip()]
results = {"texts": len(texts), "batch_size": 512}
try:
    import torch
    from sentence_transformers import SentenceTransformer

    results["torch"] = torch.__version__
    results["gpu"] = torch.cuda.get_device_name(0)

    def load(dtype):
        try:
            return SentenceTransformer(model_dir, device="cuda", model_kwargs={"dtype": dtype})
        except TypeError:
            return SentenceTransformer(model_dir, device="cuda", model_kwargs={"torch_dtype": dtype})

    for dtype, name in [(torch.float16, "f16"), (torch.float32, "f32")]:
        if time.perf_counter() - t_start > budget * 0.6:
            results[f"{name}_skipped"] = "out of time"
            continue
        try:
            st = load(dtype)
            st.encode(texts[:2048], batch_size=512)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            st.encode(texts, batch_size=512)
            torch.cuda.synchronize()
            results[f"{name}_texts_per_s"] = len(texts) / (time.perf_counter() - t0)
            del st
            torch.cuda.empty_cache()
        except Exception:
            traceback.print_exc()
            results[f"{name}_error"] = traceback.format_exc(limit=2)
except Exception:
    traceback.print_exc()
    results["error"] = traceback.format_exc(limit=2)
rates = {k.split("_")[0]: v for k, v in results.items() if k.endswith("_texts_per_s")}
missing = [k for k in results if k.endswith("_skipped") or k.endswith("_error")]
if missing:
    # The baseline is the faster of the two: with one missing, there is none.
    results["incomplete"] = ", ".join(missing)
elif rates:
    best = max(rates, key=rates.get)
    results["best_dtype"], results["best_texts_per_s"] = best, rates[best]
results["seconds"] = time.perf_counter() - t_start
json.dump(results, open(out_path, "w"), indent=1)
print(json.dumps(results, indent=1))
