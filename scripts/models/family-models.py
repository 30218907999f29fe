#!/usr/bin/env python3
"""Full-size random-weight folders of issue 13's encoder families, and
PyTorch's CUDA-graph replay of them (scripts/gpu/gpu-families.sh, step c).

  family-models.py make OUT_DIR [--layers N]
      Writes OUT_DIR/{xlmr,mpnet,bert-ce}/: the test folders'
      (tests/data/models) tokenizer and sentence-transformers module files
      with each family's real dimensions:
        xlmr     XLMRobertaModel as paraphrase-multilingual-MiniLM-L12-v2:
                 hidden 384, 12 layers, 12 heads, intermediate 1536
                 (from xlmr-st: mean pooling, Normalize)
        mpnet    MPNetModel as all-mpnet-base-v2: hidden 768, 12 layers,
                 12 heads, intermediate 3072, 32 relative-position buckets
                 (from mpnet-st: mean pooling, Normalize)
        bert-ce  BertForSequenceClassification as ms-marco-MiniLM-L-6-v2:
                 hidden 384, 6 layers, 12 heads, intermediate 1536, 1 label
                 (from bert-cross-encoder: the real MiniLM tokenizer, Sigmoid)
      The vocabulary is the test tokenizer's. Weights in f16 safetensors,
      named as transformers' save_pretrained names them (the test folders'
      names with layer.0 repeated), drawn from numpy's PCG64 seeded by the
      tensor name: deterministic, and numpy alone is needed (no torch), so
      it runs on any machine. --layers overrides the depth (a quick dry run).

  family-models.py torch OUT_JSON FOLDER...
      On a GPU: each folder loaded with transformers in f16 (eager
      attention), its forward (encoder + mean pooling + L2 normalisation,
      or the classifier + the folder's activation) captured in a
      torch.cuda.CUDAGraph at (1, 16) and (32, 128); replay + synchronize
      p50/p90/p99, and the round trip with the pinned copies a server makes
      (ids in, output out), as scripts/bench/torch-baseline.py does for MiniLM.
"""
import json
import os
import shutil
import struct
import sys
import zlib

import numpy as np

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
TEST_MODELS = os.path.join(REPO, "tests", "data", "models")

FAMILIES = {
    # name: (test folder, hidden, layers, heads, intermediate)
    "xlmr": ("xlmr-st", 384, 12, 12, 1536),
    "mpnet": ("mpnet-st", 768, 12, 12, 3072),
    "bert-ce": ("bert-cross-encoder", 384, 6, 12, 1536),
}
SHAPES = [(1, 16), (32, 128)]


def read_safetensors_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


def write_safetensors(path, tensors):
    """tensors: list of (name, np.ndarray f16), written in name order."""
    header, offset = {}, 0
    for name, a in sorted(tensors, key=lambda t: t[0]):
        nbytes = a.size * 2
        header[name] = {"dtype": "F16", "shape": list(a.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for _, a in sorted(tensors, key=lambda t: t[0]):
            f.write(np.ascontiguousarray(a, dtype="<f2").tobytes())


def new_shape(name, shape, small, big):
    """The test tensor's shape at the family's dimensions (by name and size)."""
    h0, i0, nh0 = small
    h, i, nh = big
    if name.endswith("relative_attention_bias.weight"):  # [buckets, heads]
        return [shape[0], nh]
    out = []
    for d in shape:
        out.append(h if d == h0 else i if d == i0 else d)
    return out


def draw(name, shape, cfg, h):
    rng = np.random.Generator(np.random.PCG64(zlib.crc32(name.encode())))
    leaf = name.rsplit(".", 2)
    if "LayerNorm" in name:
        base = 1.0 if name.endswith("weight") else 0.0
        return (base + rng.normal(0.0, 0.05, shape)).astype(np.float16)
    if name.endswith("relative_attention_bias.weight"):
        # Large, so that the bias visibly moves the attention.
        return rng.normal(0.0, 1.0, shape).astype(np.float16)
    if "embeddings" in name:
        a = rng.normal(0.0, 0.5, shape)
        pad = cfg.get("pad_token_id")
        if pad is not None and ("word_embeddings" in name or "position_embeddings" in name) and shape[0] > pad:
            a[pad] = 0.0  # padding rows are zero, as in trained models
        return a.astype(np.float16)
    if name.endswith("bias"):
        return rng.normal(0.0, 0.02, shape).astype(np.float16)
    # Matrices [out, in]: std 1/sqrt(in), so attention is far from uniform.
    del leaf
    return rng.normal(0.0, 1.0 / np.sqrt(shape[-1]), shape).astype(np.float16)


def make(out_dir, layers_override=None):
    os.makedirs(out_dir, exist_ok=True)
    made = {}
    for fam, (src_name, h, layers, nh, inter) in FAMILIES.items():
        if layers_override:
            layers = layers_override
        src = os.path.join(TEST_MODELS, src_name)
        dst = os.path.join(out_dir, fam)
        if os.path.exists(dst):
            shutil.rmtree(dst)
        # Everything but the weights, the reference and the model config,
        # at the top level only (1_Pooling/config.json and the like stay).
        top = os.path.abspath(src)
        shutil.copytree(src, dst, ignore=lambda d, names: [
            n for n in names
            if os.path.abspath(d) == top and n in ("model.safetensors", "reference.jsonl", "config.json")])
        cfg = json.load(open(os.path.join(src, "config.json")))
        small = (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"])
        src_layers = cfg["num_hidden_layers"]
        header = read_safetensors_header(os.path.join(src, "model.safetensors"))
        tensors = []
        for name, info in header.items():
            if name == "__metadata__":
                continue
            shape = new_shape(name, info["shape"], small, (h, inter, nh))
            if ".layer.0." in name:
                for l in range(layers):
                    n = name.replace(".layer.0.", f".layer.{l}.")
                    tensors.append((n, draw(n, shape, cfg, h)))
            elif any(f".layer.{l}." in name for l in range(1, src_layers)):
                continue
            else:
                tensors.append((name, draw(name, shape, cfg, h)))
        write_safetensors(os.path.join(dst, "model.safetensors"), tensors)
        cfg.update(hidden_size=h, num_hidden_layers=layers, num_attention_heads=nh, intermediate_size=inter,
                   dtype="float16")
        cfg.pop("torch_dtype", None)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
            f.write("\n")
        # The Pooling module's width is the hidden size.
        pool = os.path.join(dst, "1_Pooling", "config.json")
        if os.path.exists(pool):
            pc = json.load(open(pool))
            for k in ("word_embedding_dimension", "embedding_dimension"):
                if pc.get(k) == small[0]:
                    pc[k] = h
            with open(pool, "w") as f:
                json.dump(pc, f, indent=2)
                f.write("\n")
        params = sum(int(np.prod(a.shape)) for _, a in tensors)
        made[fam] = {"folder": dst, "hidden": h, "layers": layers, "heads": nh, "intermediate": inter,
                     "vocab": cfg["vocab_size"], "params": params}
        print(f"{fam}: {dst} ({params / 1e6:.1f}M parameters)", flush=True)
    with open(os.path.join(out_dir, "families.json"), "w") as f:
        json.dump(made, f, indent=1)


def torch_times(out_json, folders):
    import traceback

    import torch
    from transformers import AutoModel, AutoModelForSequenceClassification

    # The CUDA-graph timing the MiniLM baselines use lives beside them.
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
    from cuda_graph_timing import replay_latency

    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    results = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}

    def load(cls, folder):
        try:
            m = cls.from_pretrained(folder, dtype=torch.float16, attn_implementation="eager")
        except TypeError:
            m = cls.from_pretrained(folder, torch_dtype=torch.float16, attn_implementation="eager")
        return m.to(dev).eval()

    for folder in folders:
        fam = os.path.basename(os.path.normpath(folder))
        cfg = json.load(open(os.path.join(folder, "config.json")))
        cross = any(a.endswith("ForSequenceClassification") for a in cfg.get("architectures", []))
        model = load(AutoModelForSequenceClassification if cross else AutoModel, folder)
        vocab = cfg["vocab_size"]
        for b, s in SHAPES:
            key = f"{fam}_f16_{b}x{s}"
            ids = torch.randint(5, vocab - 1, (b, s), device=dev)
            mask = torch.ones(b, s, dtype=torch.long, device=dev)
            types = torch.zeros(b, s, dtype=torch.long, device=dev)

            base = getattr(model, model.base_model_prefix, model)
            # MPNet's relative position bias depends on the shape only; its
            # encoder builds it with host-side tensors a graph cannot
            # capture, so it is computed once here, outside the graph (as
            # replayd keeps its bias table on the device).
            position_bias = None
            if hasattr(base.encoder, "relative_attention_bias"):
                with torch.no_grad():
                    position_bias = base.encoder.compute_position_bias(base.embeddings(input_ids=ids))

            def hidden():
                # The model's own embedding and layer modules (its forward
                # builds the attention mask with host-side work that a
                # graph cannot capture, as torch-baseline.py notes for
                # BertModel); no mask is needed, it is all ones. MPNet's
                # layers take the relative position bias its encoder
                # computes once.
                h = base.embeddings(input_ids=ids)
                kw = {} if position_bias is None else {"position_bias": position_bias}
                for layer in base.encoder.layer:
                    h = layer(h, attention_mask=None, **kw)
                    h = h[0] if isinstance(h, tuple) else h
                return h

            def pooled(h):
                m = mask.unsqueeze(-1).to(h.dtype)
                e = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
                return torch.nn.functional.normalize(e.float(), dim=-1)

            def head(h):
                # BERT: pooler (dense + tanh on [CLS]) then classifier;
                # XLM-R's classification head takes the sequence itself.
                if getattr(base, "pooler", None) is not None and hasattr(model, "bert"):
                    return model.classifier(base.pooler(h))
                return model.classifier(h)

            if cross:
                def fwd():
                    return torch.sigmoid(head(hidden()).float())

                def whole():
                    return torch.sigmoid(model(input_ids=ids, token_type_ids=types).logits.float())
            else:
                def fwd():
                    return pooled(hidden())

                def whole():
                    return pooled(model(input_ids=ids).last_hidden_state)
            # The module path must compute what the model's forward does.
            try:
                with torch.no_grad():
                    want, got = whole().float(), fwd().float()
                    agree = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0).item()
            except Exception:
                traceback.print_exc()
                agree = None
            try:
                with torch.no_grad():
                    r, _ = replay_latency(fwd, iters=1000, static_input=ids)
                r["rows_per_s"] = b / r["p50_us"] * 1e6
                r["module_path_vs_forward_cosine"] = agree
                results[key] = r
                print(key, json.dumps(r), flush=True)
            except Exception:
                traceback.print_exc()
                results[key] = {"error": traceback.format_exc(limit=3)}
        del model
        torch.cuda.empty_cache()
    with open(out_json, "w") as f:
        json.dump(results, f, indent=1)


def main(argv):
    if len(argv) >= 2 and argv[0] == "make":
        layers = None
        if "--layers" in argv:
            layers = int(argv[argv.index("--layers") + 1])
        make(argv[1], layers)
    elif len(argv) >= 3 and argv[0] == "torch":
        torch_times(argv[1], argv[2:])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
