#!/usr/bin/env python3
"""PyTorch baselines for the GPU check, measured in the same call as replayd.

* Reference embeddings for the MiniLM folder we serve (computed with
  sentence-transformers on the same weights, in f32), written as JSONL
  (text, embedding) for replayd-loadgen --texts to verify against.
* replay+sync latency of PyTorch's own CUDA-graph replay (torch.cuda.CUDAGraph)
  for the seed MLP at batch 8 and for MiniLM (BertModel + mean pooling + L2
  normalisation, as sentence-transformers computes it) at (1, 16) and
  (32, 128), in f32 and f16.
* sentence-transformers' own encode() throughput on the reference texts.

Usage: torch-baseline.py MODEL_DIR MLP_SAFETENSORS TEXTS_JSONL OUT_DIR
Writes OUT_DIR/torch_baseline.json and OUT_DIR/reference_f32.jsonl.
"""
import json
import sys
import time
import traceback

import torch
from safetensors.torch import load_file

from cuda_graph_timing import load_encoder, minilm_graph_latency, replay_latency

model_dir, mlp_path, texts_path, out_dir = sys.argv[1:5]
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = torch.device("cuda")
results = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}


# --- MLP 128 -> 256 ReLU -> 10, f32, batch 8
sd = load_file(mlp_path)
mlp = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
mlp.load_state_dict(sd)
mlp = mlp.to(dev).eval()
x = torch.randn(8, 128, device=dev)
with torch.no_grad():
    results["mlp_f32_b8"], _ = replay_latency(lambda: mlp(x), static_input=x)

# --- MiniLM through transformers (what sentence-transformers runs), pooled.
texts = [json.loads(l)["text"] for l in open(texts_path)]


def encoder(dtype):
    return load_encoder(model_dir, dtype)


def sentence_transformer(dtype):
    try:
        return SentenceTransformer(model_dir, device="cuda", model_kwargs={"dtype": dtype})
    except TypeError:
        return SentenceTransformer(model_dir, device="cuda", model_kwargs={"torch_dtype": dtype})


for dtype, name in [(torch.float32, "f32"), (torch.float16, "f16")]:
    bert = encoder(dtype)
    for b, s in [(1, 16), (32, 128), (128, 128)]:
        try:
            results[f"minilm_{name}_{b}x{s}"] = minilm_graph_latency(bert, b, s)
        except Exception:
            traceback.print_exc()
            results[f"minilm_{name}_{b}x{s}"] = {"error": traceback.format_exc(limit=2)}
    del bert
    torch.cuda.empty_cache()

# --- Sanity: the captured forward above computes what sentence-transformers does.
try:
    from sentence_transformers import SentenceTransformer  # noqa: E402

    bert = encoder(torch.float32)
    st = sentence_transformer(torch.float32)
    sample = texts[:16]
    with torch.no_grad():
        want = st.encode(sample, convert_to_tensor=True).float()
        worst = 1.0
        for t, w in zip(sample, want):
            ids = st.tokenizer(t, return_tensors="pt", truncation=True, max_length=256)["input_ids"].to(dev)
            h = bert.embeddings(input_ids=ids)
            for layer in bert.encoder.layer:
                h = layer(h, attention_mask=None)
                h = h[0] if isinstance(h, tuple) else h
            got = torch.nn.functional.normalize(h.mean(1).float(), dim=-1)[0]
            worst = min(worst, torch.nn.functional.cosine_similarity(got, w, dim=0).item())
    results["baseline_forward_vs_sentence_transformers_min_cosine"] = worst
    del bert, st
except Exception:
    traceback.print_exc()

# --- Reference embeddings (f32) and sentence-transformers throughput.
from sentence_transformers import SentenceTransformer  # noqa: E402

st = sentence_transformer(torch.float32)
emb = st.encode(texts, batch_size=64, convert_to_numpy=True, normalize_embeddings=False)
with open(f"{out_dir}/reference_f32.jsonl", "w") as f:
    for t, e in zip(texts, emb):
        f.write(json.dumps({"text": t, "embedding": [float(v) for v in e]}) + "\n")
for dtype, name in [(torch.float32, "f32"), (torch.float16, "f16")]:
    try:
        st = sentence_transformer(dtype)
        corpus = texts * 10
        st.encode(corpus[:256], batch_size=128)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        st.encode(corpus, batch_size=128)
        torch.cuda.synchronize()
        results[f"st_encode_{name}_texts_per_s"] = len(corpus) / (time.perf_counter() - t0)
    except Exception:
        traceback.print_exc()

json.dump(results, open(f"{out_dir}/torch_baseline.json", "w"), indent=1)
print(json.dumps(results, indent=1))
