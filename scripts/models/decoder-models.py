#!/usr/bin/env python3
"""Full-size random-weight decoder embedding models for the GPU checks of issue
34 (scripts/gpu/gpu-decoders.sh), and their baselines. Needs torch,
transformers and sentence-transformers (the GPU machine has them).

  decoder-models.py make OUT_DIR [--layers N]
      OUT_DIR/qwen3-0.6b: Qwen3-Embedding-0.6B's shapes (hidden 1024, 28
      layers, 16 query and 8 key/value heads of 128, intermediate 3072,
      vocabulary 151,669), bf16, three safetensors shards; last-token pooling,
      Normalize, the query prompt; maximum length 32,768.
      OUT_DIR/embeddinggemma-300m: EmbeddingGemma-300m's (hidden 768, 24
      layers, 3 query heads and 1 key/value head of 256, intermediate 1152,
      vocabulary 262,144, sliding window 512 in five of every six layers,
      query_pre_attn_scalar 256), bf16; mean pooling, Dense 768→3072→768,
      Normalize; maximum length 2,048.
      Weights drawn by transformers' own initialisation (seeded); the
      sentence-transformers files and the (small) tokenizers are those of
      tests/data/models/{qwen3,gemma3}-st. --layers N: fewer layers (dry runs).

  decoder-models.py reference FOLDER OUT_JSONL DTYPE [N] [natural|short|long]
      N texts (default 48) encoded by sentence-transformers in DTYPE
      (bfloat16 or float32) on the GPU: of natural lengths (a few words to a
      few hundred tokens), short queries (4–12 words), or long documents
      (about 8,000 words: tens of thousands of tokens, cut at the folder's
      maximum). Lines {"text", "ids", "embedding"} for `replayd backend-check
      --references` and replayd-loadgen --texts.

  decoder-models.py torch-speed OUT_JSON FOLDER...
      transformers' model (attn_implementation="sdpa", bf16) at (1, 16),
      (32, 128), (128, 128) (16,384 tokens) and (8, 2048) (TORCH_SHAPES,
      e.g. "1x16,128x128", picks others): eager forward and
      the same forward replayed as a CUDA graph (with its copies), last-token
      or mean pooling and L2 as sentence-transformers does; p50 µs of each.
"""
import json
import os
import random
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..", "..", "tests", "data", "models")

QWEN3_06B = dict(
    hidden_size=1024,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=3072,
    vocab_size=151669,
    max_position_embeddings=32768,
)
GEMMA_300M = dict(
    hidden_size=768,
    num_hidden_layers=24,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=256,
    intermediate_size=1152,
    vocab_size=262144,
    max_position_embeddings=2048,
    sliding_window=512,
    query_pre_attn_scalar=256,
)


def copy_st_files(src, dst, skip=("config.json", "reference.jsonl")):
    for name in os.listdir(src):
        if name in skip or name.endswith(".safetensors") or name.endswith(".index.json"):
            continue
        s, d = os.path.join(src, name), os.path.join(dst, name)
        if os.path.isdir(s):
            shutil.copytree(s, d, dirs_exist_ok=True)
        else:
            shutil.copy(s, d)


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def make(out_dir, layers=None):
    import torch
    from transformers import Gemma3TextConfig, Gemma3TextModel, Qwen3Config, Qwen3Model

    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    # Qwen3-Embedding-0.6B
    dst = os.path.join(out_dir, "qwen3-0.6b")
    os.makedirs(dst, exist_ok=True)
    base = json.load(open(os.path.join(TESTS, "qwen3-st", "config.json")))
    shape = dict(QWEN3_06B)
    if layers:
        shape["num_hidden_layers"] = layers
    base.update(shape)
    base["layer_types"] = ["full_attention"] * shape["num_hidden_layers"]
    base["max_window_layers"] = shape["num_hidden_layers"]
    cfg = Qwen3Config(**{k: v for k, v in base.items() if k not in ("architectures", "transformers_version", "dtype")})
    model = Qwen3Model(cfg).to(torch.bfloat16)
    model.save_pretrained(dst, max_shard_size="500MB")
    copy_st_files(os.path.join(TESTS, "qwen3-st"), dst)
    write_json(os.path.join(dst, "sentence_bert_config.json"), {"max_seq_length": 32768, "do_lower_case": False})
    pool = json.load(open(os.path.join(dst, "1_Pooling", "config.json")))
    pool["embedding_dimension"] = shape["hidden_size"]
    write_json(os.path.join(dst, "1_Pooling", "config.json"), pool)
    del model
    # EmbeddingGemma-300m
    dst = os.path.join(out_dir, "embeddinggemma-300m")
    os.makedirs(dst, exist_ok=True)
    base = json.load(open(os.path.join(TESTS, "gemma3-st", "config.json")))
    shape = dict(GEMMA_300M)
    if layers:
        shape["num_hidden_layers"] = layers
    n = shape["num_hidden_layers"]
    base.update(shape)
    base["layer_types"] = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    if "full_attention" not in base["layer_types"]:
        base["layer_types"][-1] = "full_attention"
    base.pop("_sliding_window_pattern", None)
    cfg = Gemma3TextConfig(**{k: v for k, v in base.items() if k not in ("architectures", "transformers_version", "dtype")})
    model = Gemma3TextModel(cfg).to(torch.bfloat16)
    model.save_pretrained(dst)
    copy_st_files(os.path.join(TESTS, "gemma3-st"), dst)
    write_json(os.path.join(dst, "sentence_bert_config.json"), {"max_seq_length": 2048, "do_lower_case": False})
    pool = json.load(open(os.path.join(dst, "1_Pooling", "config.json")))
    pool["embedding_dimension"] = shape["hidden_size"]
    write_json(os.path.join(dst, "1_Pooling", "config.json"), pool)
    from safetensors.torch import save_file

    h = shape["hidden_size"]
    for sub, (i, o) in (("2_Dense", (h, 3072)), ("3_Dense", (3072, h))):
        c = json.load(open(os.path.join(dst, sub, "config.json")))
        c["in_features"], c["out_features"] = i, o
        write_json(os.path.join(dst, sub, "config.json"), c)
        w = (torch.randn(o, i) / i**0.5).to(torch.bfloat16)
        save_file({"linear.weight": w.contiguous()}, os.path.join(dst, sub, "model.safetensors"))
    print(json.dumps({"made": sorted(os.listdir(out_dir))}))


WORDS = (
    "the graph is replayed for every batch of texts that the daemon gathers from its clients and each "
    "bucket holds a fixed shape so nothing is launched twice while the encoder runs on a warm device "
    "with pinned buffers ready der Hund läuft schnell über die Straße le chat dort sur la table el "
    "tiempo pasa rápido 2024 replay 42 tokens search retrieval passage query answer"
).split()


def texts(n, kind="natural", seed=7):
    """n texts: natural lengths (lognormal word counts, mean about 25, a tail
    to a few hundred), short queries, or long documents."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if kind == "short":
            words = rng.randint(4, 12)
        elif kind == "long":
            words = rng.randint(7000, 9000)
        else:
            words = max(1, min(600, int(rng.lognormvariate(3.0, 0.8))))
        out.append(" ".join(rng.choice(WORDS) for _ in range(words)))
    return out


def reference(folder, out_jsonl, dtype, n=48, kind="natural"):
    import torch
    from sentence_transformers import SentenceTransformer

    dt = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    st = SentenceTransformer(folder, device=device, model_kwargs={"dtype": dt})
    xs = texts(n, kind)
    emb = st.encode(xs, batch_size=1 if kind == "long" else 16, convert_to_numpy=True, normalize_embeddings=False)
    tok = st.tokenizer
    lens = []
    with open(out_jsonl, "w") as f:
        for text, e in zip(xs, emb):
            ids = tok(text, truncation=True, max_length=st.max_seq_length)["input_ids"]
            lens.append(len(ids))
            f.write(json.dumps({"text": text, "ids": ids, "embedding": [float(v) for v in e]}) + "\n")
    print(json.dumps({"folder": folder, "dtype": dtype, "rows": len(xs), "tokens_min": min(lens), "tokens_max": max(lens)}))


def torch_speed(out_json, folders):
    import statistics
    import time
    import traceback

    import torch
    from transformers import AutoModel

    sys.path.insert(0, os.path.join(HERE, "..", "bench"))
    from cuda_graph_timing import replay_latency

    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    results = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
    for folder in folders:
        name = os.path.basename(os.path.normpath(folder))
        model = AutoModel.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="sdpa").to(dev).eval()
        cfg = model.config
        last = cfg.model_type == "qwen3"
        shapes = os.environ.get("TORCH_SHAPES", "1x16,32x128,128x128,8x2048")
        for b, s in (tuple(int(v) for v in x.split("x")) for x in shapes.split(",")):
            key = f"{name}_bf16_{b}x{s}"
            ids = torch.randint(300, 500, (b, s), device=dev)

            def fwd():
                h = model(input_ids=ids).last_hidden_state
                e = h[:, -1] if last else h.mean(1)
                return torch.nn.functional.normalize(e.float(), dim=-1)

            r = {}
            try:
                with torch.no_grad():
                    for _ in range(3):
                        fwd()
                    torch.cuda.synchronize()
                    samples = []
                    for _ in range(30 if b * s > 4096 else 200):
                        t0 = time.perf_counter()
                        fwd()
                        torch.cuda.synchronize()
                        samples.append((time.perf_counter() - t0) * 1e6)
                    r["eager_p50_us"] = statistics.median(samples)
            except Exception:
                r["eager_error"] = traceback.format_exc(limit=2)
            try:
                with torch.no_grad():
                    g, _ = replay_latency(fwd, iters=100 if b * s > 4096 else 500, static_input=ids)
                r["graph"] = g
            except Exception:
                r["graph_error"] = traceback.format_exc(limit=2)
            best = [v for v in (r.get("eager_p50_us"), r.get("graph", {}).get("with_copies", {}).get("p50_us")) if v]
            r["best_p50_us"] = min(best) if best else None
            results[key] = r
            print(key, json.dumps(r), flush=True)
        del model
        torch.cuda.empty_cache()
    with open(out_json, "w") as f:
        json.dump(results, f, indent=1)


def main(argv):
    if not argv:
        print(__doc__)
        return 2
    cmd = argv[0]
    if cmd == "make":
        layers = int(argv[argv.index("--layers") + 1]) if "--layers" in argv else None
        make(argv[1], layers)
    elif cmd == "reference":
        reference(argv[1], argv[2], argv[3], int(argv[4]) if len(argv) > 4 else 48, argv[5] if len(argv) > 5 else "natural")
    elif cmd == "torch-speed":
        torch_speed(argv[1], argv[2:])
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
