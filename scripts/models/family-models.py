#!/usr/bin/env python3
"""Full-size random-weight folders of issue 13's encoder families (and of
issue 33's speed set and issue 32's scale set), and PyTorch's CUDA-graph
replay of them (scripts/gpu/gpu-families.sh, step c).

  family-models.py make OUT_DIR [--layers N]
      (the default set) Writes OUT_DIR/{xlmr,mpnet,bert-ce}/: the test folders'
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

  family-models.py make OUT_DIR --set speed [--layers N]
      Issue 33's speed set (scripts/gpu/gpu-family-speed.sh): families
      against BERT of the same width and depth, each folder's maximum
      length 512 (tokenizer_config.json model_max_length, the
      sentence-transformers max_seq_length where the folder has one, the
      position table), so that (8, 512) buckets are allowed:
        bert-768x12        BertModel 768, 12 layers, 12 heads, intermediate 3072
                           (from bert-st-old: mean pooling, Normalize)
        bert-768x6         the same with 6 layers
        distilbert-768x6   DistilBertModel 768, 6 layers, 12 heads, hidden_dim
                           3072 (from distilbert-st); timed against bert-768x6
        modernbert-768x12  ModernBertModel at ModernBERT-base's widths, 12
                           layers: 768, 12 heads, intermediate 1152 (Wi 2304
                           wide, GeGLU), global attention every third layer
                           from layer 0, sliding windows of 128 between
                           (transformers 5's layer_types and rope_parameters,
                           thetas 160000 / 10000), from modernbert-st; timed
                           against bert-768x12
      families.json also holds each folder's baseline and what its FLOPs
      depend on. ARCHS says how each architecture's test folder is rescaled
      (config keys, fused tensors); GTE and NomicBERT have entries there, and
      SPEED lines to uncomment, for when their test folders exist.

  family-models.py make OUT_DIR --set scale [--layers N]
      Issue 32's scale set (scripts/bench/kernels-at-scale.sh): BERT at the
      three sizes people deploy, each from bert-st-old (mean pooling,
      Normalize) with a maximum length of 512 as in the speed set:
        minilm-384x6   BertModel 384, 6 layers, 12 heads, intermediate 1536
                       (all-MiniLM-L6-v2's shape)
        bert-768x12    BertModel 768, 12 layers, 12 heads, intermediate 3072
                       (BERT-base)
        bert-1024x24   BertModel 1024, 24 layers, 16 heads, intermediate 4096
                       (BERT-large)
      Head size 32 (MiniLM) and 64 (BERT-base and -large). families.json
      as for the speed set (no baselines).

  family-models.py reference FOLDER OUT_JSONL MIN_TOKENS MAX_TOKENS N
      N texts of MIN..MAX tokens (the folder's tokenizer, special tokens
      included) and their sentence-transformers embeddings (f32, CPU), for
      replayd-loadgen --texts (the speed script's dry run). Exit status 3
      where sentence-transformers is missing.

  family-models.py speed-table CHECK_JSON FAMILIES_JSON [--backend cuda|cpu]
                               [--shapes 32x128,8x512] [--target 1.3]
      The speed script's markdown table from backend-check's JSON; exit
      status 1 unless RESULT: PASS. dryrun-json writes the dry run's
      replayd-loadgen reports in backend-check's JSON shape.

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
import re
import shutil
import struct
import sys
import zlib

import numpy as np

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
TEST_MODELS = os.path.join(REPO, "tests", "data", "models")

BERT_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")


def modernbert_config(cfg, layers):
    """ModernBERT-base's attention layout at this depth (transformers 5 keys):
    global attention every third layer from layer 0, sliding windows of 128
    tokens (±64) between, ModernBERT-base's rotary bases."""
    cfg["layer_types"] = ["full_attention" if l % 3 == 0 else "sliding_attention" for l in range(layers)]
    cfg["local_attention"] = 128
    if "global_attn_every_n_layers" in cfg:
        cfg["global_attn_every_n_layers"] = 3
    cfg["rope_parameters"] = {"full_attention": {"rope_theta": 160000.0, "rope_type": "default"},
                              "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}}
    for old in ("global_rope_theta", "local_rope_theta"):
        cfg.pop(old, None)
    cfg["max_position_embeddings"] = max(cfg.get("max_position_embeddings", 0), 8192)


# How to rescale a test folder of each architecture, by config.json's
# model_type:
#   keys   config keys of (hidden, layers, heads, intermediate); a list of
#          such tuples where one model_type has two layouts (the first whose
#          keys the config has)
#   fused  (part of the tensor name, axis, multiple, "h" or "i"): that axis is
#          multiple × hidden or intermediate. By name, not by size: in
#          modernbert-st, Wqkv's 96 = 3·32 and Wi's 96 = 2·48.
#   glu    the MLP is gated (two input matrices of intermediate, or one of
#          2 × intermediate): 3·h·i multiply-adds a token, for the FLOP count
#   config a function (config dict, layers) for architecture-specific keys
#   positions  the config keys of the position table's length (the first the
#          config has)
# Every other axis equal to the test folder's hidden or intermediate size is
# scaled to the new one; a config's head_dim follows hidden / heads. Layer
# N's tensors are `…layer.N.…` or `…layers.N.…`.
ARCHS = {
    "bert": dict(keys=BERT_KEYS),
    "xlm-roberta": dict(keys=BERT_KEYS),
    "mpnet": dict(keys=BERT_KEYS),
    "distilbert": dict(keys=("dim", "n_layers", "n_heads", "hidden_dim")),
    "modernbert": dict(keys=BERT_KEYS, fused=(("attn.Wqkv.", 0, 3, "h"), ("mlp.Wi.", 0, 2, "i")), glu=True,
                       config=modernbert_config),
    # Hooks for the next families: their rescaling, checked (shapes, and
    # sentence-transformers loads the result) on the test folders gte-st,
    # gte-hub-st, nomic-st and nomic-hub-st; SPEED has their lines to
    # uncomment once replayd serves them.
    # GTE: transformers 5's GteModel ("gte") and the hub's remote-code
    # NewModel ("new"): encoder.layer.N.attention.qkv_proj [3h, h] (and its
    # bias), mlp.up_gate_proj [2i, h], attn_ln / mlp_ln.
    "gte": dict(keys=BERT_KEYS, fused=(("attention.qkv_proj.", 0, 3, "h"), ("mlp.up_gate_proj.", 0, 2, "i")),
                glu=True),
    "new": dict(keys=BERT_KEYS, fused=(("attention.qkv_proj.", 0, 3, "h"), ("mlp.up_gate_proj.", 0, 2, "i")),
                glu=True),
    # NomicBERT: transformers 5's (hidden_size, …, head_dim) or the hub's
    # (n_embd, n_layer, n_head, n_inner, n_positions); encoder.layers.N.
    # attn.Wqkv [3h, h], mlp.fc11 / fc12 [i, h] (SwiGLU), fc2 [h, i], emb_ln.
    "nomic_bert": dict(keys=[BERT_KEYS, ("n_embd", "n_layer", "n_head", "n_inner")],
                       positions=("max_position_embeddings", "n_positions"),
                       fused=(("attn.Wqkv.", 0, 3, "h"),), glu=True),
}


def arch_keys(arch, cfg):
    """The (hidden, layers, heads, intermediate) config keys this config uses."""
    keys = arch["keys"]
    for k in ([keys] if isinstance(keys[0], str) else keys):
        if all(x in cfg for x in k):
            return k
    sys.exit(f"config.json ({cfg.get('model_type')}) has none of the key sets {keys}")


def positions_key(arch, cfg):
    keys = arch.get("positions", ("max_position_embeddings",))
    return next((k for k in keys if k in cfg), keys[0])


# The default set (issue 13's families), name: (test folder, hidden, layers,
# heads, intermediate).
FAMILIES = {
    "xlmr": ("xlmr-st", 384, 12, 12, 1536),
    "mpnet": ("mpnet-st", 768, 12, 12, 3072),
    "bert-ce": ("bert-cross-encoder", 384, 6, 12, 1536),
}
# The speed set (issue 33: each family's µs per token against BERT's at the
# same width and depth), name: (test folder, hidden, layers, heads,
# intermediate, the BERT folder it is timed against). All with a maximum
# length of at least SPEED_MAX_LEN, so that (8, 512) buckets are allowed.
SPEED = {
    "bert-768x12": ("bert-st-old", 768, 12, 12, 3072, None),
    "bert-768x6": ("bert-st-old", 768, 6, 12, 3072, None),
    "distilbert-768x6": ("distilbert-st", 768, 6, 12, 3072, "bert-768x6"),
    # ModernBERT-base's widths (its intermediate is 1152, GeGLU), at 12
    # layers (the real one has 22).
    "modernbert-768x12": ("modernbert-st", 768, 12, 12, 1152, "bert-768x12"),
    # gte-base-en-v1.5's and nomic-embed-text-v1.5's widths (both with a
    # gated MLP of 3072: more FLOPs than BERT's).
    "gte-768x12": ("gte-st", 768, 12, 12, 3072, "bert-768x12"),
    "nomic-768x12": ("nomic-st", 768, 12, 12, 3072, "bert-768x12"),
}
# The scale set (issue 32: the kernels against PyTorch at BERT's sizes),
# name: (test folder, hidden, layers, heads, intermediate, baseline), as
# SPEED, each with a maximum length of SPEED_MAX_LEN.
SCALE = {
    "minilm-384x6": ("bert-st-old", 384, 6, 12, 1536, None),
    "bert-768x12": ("bert-st-old", 768, 12, 12, 3072, None),
    "bert-1024x24": ("bert-st-old", 1024, 24, 16, 4096, None),
}
SETS = {"default": FAMILIES, "speed": SPEED, "scale": SCALE}
# The torch subcommand's shapes.
SHAPES = [(1, 16), (32, 128)]
SPEED_MAX_LEN = 512
LAYER_RE = re.compile(r"(^|\.)(layers?)\.(\d+)\.")


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


def new_shape(name, shape, small, big, fused=(), positions=None):
    """The test tensor's shape at the family's dimensions (by name and size).
    positions: (old, new) length of the position table, when it grows."""
    h0, i0, nh0 = small
    h, i, nh = big
    if name.endswith("relative_attention_bias.weight"):  # [buckets, heads]
        return [shape[0], nh]
    out = []
    for axis, d in enumerate(shape):
        for part, ax, mult, base in fused:
            if part in name and ax == axis and d == mult * (h0 if base == "h" else i0):
                out.append(mult * (h if base == "h" else i))
                break
        else:
            if positions and axis == 0 and "position_embeddings" in name and d == positions[0]:
                out.append(positions[1])
            else:
                out.append(h if d == h0 else i if d == i0 else d)
    return out


def is_norm(name, shape):
    """A LayerNorm's weight or bias (BERT's `LayerNorm`, DistilBERT's
    `sa_layer_norm`, ModernBERT's `attn_norm`/`final_norm`, GTE's `attn_ln`)."""
    if "LayerNorm" in name:
        return True
    return len(shape) == 1 and ("norm" in name.lower() or re.search(r"(^|[._])\w*ln\.(weight|bias)$", name))


def draw(name, shape, cfg, h):
    rng = np.random.Generator(np.random.PCG64(zlib.crc32(name.encode())))
    if is_norm(name, shape):
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
    return rng.normal(0.0, 1.0 / np.sqrt(shape[-1]), shape).astype(np.float16)


def set_max_length(dst, cfg, arch, n):
    """At least n tokens: the position table, tokenizer_config.json's
    model_max_length and sentence_bert_config.json's max_seq_length (the
    one sentence-transformers and replayd use first)."""
    key = positions_key(arch, cfg)
    if key in cfg and cfg[key] < n:
        cfg[key] = n
    tc = os.path.join(dst, "tokenizer_config.json")
    if os.path.exists(tc):
        t = json.load(open(tc))
        t["model_max_length"] = n
        with open(tc, "w") as f:
            json.dump(t, f, indent=2)
            f.write("\n")
    sc = os.path.join(dst, "sentence_bert_config.json")
    if os.path.exists(sc):
        s = json.load(open(sc))
        changed = False
        if "max_seq_length" in s:
            s["max_seq_length"], changed = n, True
        if isinstance(s.get("processor_kwargs"), dict) and "model_max_length" in s["processor_kwargs"]:
            s["processor_kwargs"]["model_max_length"], changed = n, True
        if changed:
            with open(sc, "w") as f:
                json.dump(s, f, indent=2)
                f.write("\n")


def make_folder(dst, src_name, h, layers, nh, inter, max_len=None):
    """One folder: the test folder's files with the weights drawn at the new
    dimensions. Returns (its entry of families.json, the config written,
    its ARCHS entry)."""
    src = os.path.join(TEST_MODELS, src_name)
    if os.path.exists(dst):
        shutil.rmtree(dst)
    # Everything but the weights, the reference and the model config,
    # at the top level only (1_Pooling/config.json and the like stay).
    top = os.path.abspath(src)
    shutil.copytree(src, dst, ignore=lambda d, names: [
        n for n in names
        if os.path.abspath(d) == top and n in ("model.safetensors", "reference.jsonl", "config.json")])
    cfg = json.load(open(os.path.join(src, "config.json")))
    arch = ARCHS[cfg["model_type"]]
    k_h, k_l, k_nh, k_i = arch_keys(arch, cfg)
    small = (cfg[k_h], cfg[k_i], cfg[k_nh])
    if small[0] == small[1]:
        sys.exit(f"{src_name}: hidden == intermediate ({small[0]}): the shapes are ambiguous")
    src_layers = cfg[k_l]
    pos_key = positions_key(arch, cfg)
    positions = None
    if max_len and cfg.get(pos_key, max_len) < max_len:
        positions = (cfg[pos_key], max_len)
    header = read_safetensors_header(os.path.join(src, "model.safetensors"))
    # Layer 0's tensors for layer 0, layer 1's for the others (ModernBERT's
    # layer 0 has no attn_norm); their values depend on the new name only.
    by_layer = {}
    others = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        m = LAYER_RE.search(name)
        if m:
            by_layer.setdefault(int(m.group(3)), []).append((name, info, m))
        else:
            others.append((name, info))
    tensors = []

    def add(name, info):
        shape = new_shape(name, info["shape"], small, (h, inter, nh), arch.get("fused", ()), positions)
        tensors.append((name, draw(name, shape, cfg, h)))

    for l in range(layers):
        t = 0 if l == 0 or src_layers < 2 else 1
        for name, info, m in by_layer.get(t, []):
            add(name[:m.start(3)] + str(l) + name[m.end(3):], info)
    for name, info in others:
        add(name, info)
    write_safetensors(os.path.join(dst, "model.safetensors"), tensors)
    cfg.update({k_h: h, k_l: layers, k_nh: nh, k_i: inter, "dtype": "float16"})
    cfg.pop("torch_dtype", None)
    if "head_dim" in cfg:
        cfg["head_dim"] = h // nh
    if "config" in arch:
        arch["config"](cfg, layers)
    if max_len:
        set_max_length(dst, cfg, arch, max_len)
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
    entry = {"folder": dst, "hidden": h, "layers": layers, "heads": nh, "intermediate": inter,
             "vocab": cfg["vocab_size"], "params": params}
    return entry, cfg, arch


def make(out_dir, layers_override=None, which="default"):
    os.makedirs(out_dir, exist_ok=True)
    made = {}
    for fam, spec in SETS[which].items():
        src_name, h, layers, nh, inter = spec[:5]
        if layers_override:
            layers = layers_override
        dst = os.path.join(out_dir, fam)
        if which == "default":
            made[fam], _, _ = make_folder(dst, src_name, h, layers, nh, inter)
        else:
            e, cfg, arch = make_folder(dst, src_name, h, layers, nh, inter, max_len=SPEED_MAX_LEN)
            # What the speed and scale tables need: the baseline, and the
            # shapes that set the FLOPs (the MLP's kind, each layer's
            # attention span).
            kinds = cfg.get("layer_types") or ["full_attention"] * layers
            e.update(model_type=cfg["model_type"], source=src_name, baseline=spec[5],
                     glu=bool(arch.get("glu")),
                     layer_types=["full" if k == "full_attention" else "sliding" for k in kinds],
                     window=cfg.get("local_attention"))
            made[fam] = e
        print(f"{fam}: {dst} ({made[fam]['params'] / 1e6:.1f}M parameters)", flush=True)
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


# Words the dry run's texts are made of (any tokenizer splits them into
# some of its pieces).
WORDS = ("the graph is replayed for every batch of texts that the daemon gathers from its clients and "
         "each bucket holds a fixed shape so nothing is launched twice while the encoder runs on a warm "
         "device with pinned buffers ready der Hund läuft schnell über die Straße le chat dort sur la "
         "table el tiempo pasa rápido 2024 replay 42 tokens").split()


def reference(folder, out, lo, hi, n):
    """n texts of lo..hi tokens (special tokens included, by the folder's
    tokenizer) and their sentence-transformers embeddings (f32 on the CPU),
    as JSONL lines {"text", "tokens", "embedding"} (replayd-loadgen --texts).
    Exit status 3 where sentence-transformers cannot be imported."""
    try:
        import torch
        from sentence_transformers import SentenceTransformer
    except ImportError as e:
        print(f"no sentence-transformers here ({e})", file=sys.stderr)
        sys.exit(3)
    import random

    try:
        m = SentenceTransformer(folder, device="cpu", model_kwargs={"dtype": torch.float32})
    except TypeError:
        m = SentenceTransformer(folder, device="cpu", model_kwargs={"torch_dtype": torch.float32})
    m = m.float()
    tok = m.tokenizer
    rng = random.Random(zlib.crc32(f"{os.path.basename(os.path.normpath(folder))} {lo} {hi}".encode()))
    count = lambda words: len(tok(" ".join(words))["input_ids"])
    texts, lengths = [], []
    for _ in range(n):
        want = rng.randint(lo, hi)
        words = [rng.choice(WORDS)]
        while count(words) < want:
            words.append(rng.choice(WORDS))
        if count(words) > hi and len(words) > 1:
            words.pop()
        texts.append(" ".join(words))
        lengths.append(count(words))
    emb = m.encode(texts, convert_to_numpy=True, batch_size=8)
    with open(out, "w") as f:
        for t, k, e in zip(texts, lengths, emb):
            f.write(json.dumps({"text": t, "tokens": k, "embedding": [round(float(x), 8) for x in e]}) + "\n")
    print(f"{folder}: {n} texts of {min(lengths)}..{max(lengths)} tokens -> {out}")


def flops_per_token(d, seq):
    """Matmul FLOPs per token of a forward at sequence length seq (2 per
    multiply-add): Q, K, V and output projections 4h², the MLP 2hi (GLU:
    3hi), attention scores and values 2h per key attended, where a sliding
    layer attends min(seq, window + 1) keys (±window/2). Embeddings,
    LayerNorms, activations and pooling are left out."""
    h, i = d["hidden"], d["intermediate"]
    mlp = (3 if d.get("glu") else 2) * h * i
    total = 0
    for kind in d.get("layer_types") or ["full"] * d["layers"]:
        keys = seq if kind == "full" else min(seq, (d.get("window") or seq) + 1)
        total += 4 * h * h + mlp + 2 * h * keys
    return 2 * total


def speed_table(check_json, families_json, backend, shapes, target=1.3):
    """The markdown table of scripts/gpu/gpu-family-speed.sh, from
    backend-check's JSON (or the dry run's, in the same shape) and the
    speed set's families.json; ends with RESULT: PASS/FAIL (exit status)."""
    def load(p):
        try:
            return json.load(open(p))
        except Exception as e:
            print(f"(could not read {p}: {e})\n")
            return None
    bc, fams = load(check_json), load(families_json) or {}
    gated = backend == "cuda"
    ok = bool(bc) and bool(bc.get("pass")) and bool(fams)
    print("# replayd: encoder families against BERT of the same width and depth (issue 33)\n")
    dev = (bc or {}).get("device") or {}
    print(f"backend: {backend}; device: {dev.get('name', '?')}; kernels: {(bc or {}).get('kernels', '?')}\n")
    if gated:
        print("replayd p50: `replayd backend-check` launch → collect of a full random batch in the bucket's "
              "CUDA graph, pinned copies in and out included, median of the timed round trips; the served "
              "kernel paths. µs/token = p50 / (batch × seq). Ratio: the family's µs/token over the BERT "
              f"folder's of the same width and depth, in this run; target ≤ {target}×.\n")
    else:
        print("DRY RUN on the CPU backend: replayd-loadgen through the daemon, p50 of the replies' `device_us` "
              "(the worker's time per batch); check: the daemon's embeddings against sentence-transformers' "
              "(f32, on the CPU) of the same texts, min cosine. The speed target is shown, not gated: "
              "it is about the CUDA backend.\n")
    # Where a family's FLOPs differ from its BERT's, say why (from the shapes).
    notes = []
    for name, d in fams.items():
        bd = fams.get(d.get("baseline") or "")
        if not bd:
            continue
        h, i, bi = d["hidden"], d["intermediate"], bd["intermediate"]
        mlp = f"{'3' if d.get('glu') else '2'}·h·i = {(3 if d.get('glu') else 2) * h * i / 1e6:.2f}M"
        bmlp = f"{2 * bd['hidden'] * bi / 1e6:.2f}M"
        why = []
        if d.get("glu") or i != bi:
            why.append(f"its MLP is {'gated, ' if d.get('glu') else ''}intermediate {i} ({mlp} multiply-adds a "
                       f"token and layer) against BERT's {bi} ({bmlp})")
        slid = (d.get("layer_types") or []).count("sliding")
        if slid:
            why.append(f"{slid} of its {d['layers']} layers attend a sliding window of {d.get('window')} "
                       f"(±{(d.get('window') or 0) // 2}) tokens")
        if why:
            notes.append(f"{name}: not BERT's FLOPs: " + "; ".join(why) + ".")
    if "modernbert-768x12" in fams:
        notes.append("ModernBERT-base's own intermediate is 1152 (GeGLU), smaller than BERT-base's 3072, "
                     "so modernbert-768x12 does fewer FLOPs than bert-768x12: the target compares µs per "
                     "token as asked, the FLOP-normalised ratio shows the kernels' efficiency.")
    notes.append("FLOP-normalised ratio = (µs per FLOP of the family) / (µs per FLOP of its BERT); FLOPs from "
                 "the shapes, matmuls only: Q, K, V and output projections, the MLP, attention scores and "
                 "values over the keys each layer attends (2 FLOPs a multiply-add).")
    for n in notes:
        print(f"* {n}")
    print()

    def bucket(name, b, s):
        for m in (bc or {}).get("models", []):
            if m["name"] == name:
                cands = [x for x in m["buckets"] if not x.get("tokens") and (x["batch"], x["seq"]) == (b, s)]
                cands.sort(key=lambda x: not x.get("served", True))
                return cands[0] if cands else None
        return None

    print("| folder | dims (h × layers, heads, intermediate) | vs | (batch, seq) | replayd p50 µs | µs/token | "
          f"BERT µs/token | ratio | MFLOP/token (BERT) | FLOP-normalised ratio | ≤ {target}× | check vs CPU |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    misses = []
    for name, d in fams.items():
        base = d.get("baseline")
        dims = (f"{d['hidden']}×{d['layers']}, {d['heads']}, {d['intermediate']}"
                f"{' GLU' if d.get('glu') else ''}"
                f"{' (sliding ' + str(d.get('window')) + ')' if 'sliding' in (d.get('layer_types') or []) else ''}")
        for b, s in shapes:
            r = bucket(name, b, s)
            p50 = (r or {}).get("latency", {}).get("median_us") or None
            c = (r or {}).get("check") or {}
            if r is None or p50 is None:
                ok = False
                chk = "missing" if r is None else f"FAIL: {r.get('error') or 'no timing'}"
            elif not c:
                ok = False
                chk = f"FAIL: no check{': ' + r['error'] if r.get('error') else ''}"
            else:
                ok &= bool(c.get("pass"))
                chk = (f"{c.get('metric', '')} {c.get('value', float('nan')):.6f} "
                       f"{'ok' if c.get('pass') else 'FAIL'}")
            tok = b * s
            upt = p50 / tok if p50 else None
            fl = flops_per_token(d, s)
            cells = [name, dims, base or "(baseline)", f"({b}, {s})", "n/a" if p50 is None else f"{p50:.1f}",
                     "n/a" if upt is None else f"{upt:.4f}"]
            if base:
                bd = fams.get(base)
                br = bucket(base, b, s)
                bp = (br or {}).get("latency", {}).get("median_us") or None
                bupt = bp / tok if bp else None
                bfl = flops_per_token(bd, s) if bd else None
                ratio = upt / bupt if upt and bupt else None
                fratio = ratio * bfl / fl if ratio and bfl else None
                met = ratio is not None and ratio <= target
                if ratio is None:
                    ok = False
                if gated and not met:
                    misses.append(f"{name} ({b}, {s})")
                cells += ["n/a" if bupt is None else f"{bupt:.4f}", "n/a" if ratio is None else f"{ratio:.2f}×",
                          f"{fl / 1e6:.1f} ({bfl / 1e6:.1f})" if bfl else f"{fl / 1e6:.1f}",
                          "n/a" if fratio is None else f"{fratio:.2f}×",
                          ("yes" if met else "NO") + ("" if gated else " (not gated)")]
            else:
                cells += ["", "1.00×", f"{fl / 1e6:.1f}", "", ""]
            cells.append(chk)
            print("| " + " | ".join(cells) + " |")
    print()
    if bc and bc.get("failures"):
        print("backend-check failures:\n")
        for f in bc["failures"][:20]:
            print(f"* {f}")
        print()
    if misses:
        print(f"Speed target ({target}×) missed: {', '.join(misses)}\n")
        ok = False
    print("RESULT:", "PASS" if ok else "FAIL")
    return ok


def dryrun_json(out_json, families_json, loadgen_dir, shapes, min_cosine):
    """The dry run's results in backend-check's JSON shape (models → padded
    buckets → latency.median_us and check), from replayd-loadgen's reports
    loadgen_<folder>_<batch>x<seq>.json: p50 of the replies' device_us, the
    min cosine against the reference texts' embeddings (where they had
    some), and the bucket the replies came from."""
    fams = json.load(open(families_json))
    models, failures = [], []
    for name in fams:
        buckets = []
        for b, s in shapes:
            res = {"bucket": f"{b}x{s}", "batch": b, "seq": s, "tokens": None, "served": True,
                   "latency": {}, "check": None, "error": None}
            p = os.path.join(loadgen_dir, f"loadgen_{name}_{b}x{s}.json")
            try:
                lg = json.load(open(p))
            except Exception as e:
                res["error"] = f"no loadgen report ({e})"
                failures.append(f"{name} {b}x{s}: {res['error']}")
                buckets.append(res)
                continue
            hops = lg.get("hops_us") or {}
            dev = hops.get("device_us") or hops.get("device") or {}
            res["latency"] = {"iters": lg.get("ok", 0), "median_us": dev.get("p50") or lg["latency_us"]["p50"],
                              "request_p50_us": lg["latency_us"]["p50"]}
            errors = sum((lg.get("errors") or {}).values())
            used = lg.get("buckets") or {}
            problems = []
            if not lg.get("ok") or errors:
                problems.append(f"{lg.get('ok', 0)} ok, errors {lg.get('errors')}")
            if f"{b}x{s}" not in used:
                problems.append(f"replies came from buckets {used}, not {b}x{s}")
            mc = lg.get("min_cosine")
            if mc is not None:
                passed = mc >= min_cosine and not lg.get("below_min_cosine") and not problems
                res["check"] = {"metric": "min_cosine", "value": mc, "threshold": min_cosine, "pass": passed,
                                "rows": lg.get("items", lg.get("ok", 0))}
            else:
                # No reference (no sentence-transformers): the replies came.
                res["check"] = {"metric": "replies_ok (no reference)", "value": float(lg.get("ok", 0)),
                                "threshold": 1.0, "pass": not problems}
            if problems:
                res["error"] = "; ".join(problems)
            if not res["check"]["pass"]:
                failures.append(f"{name} {b}x{s}: {res['check']['metric']} {res['check']['value']}"
                                f"{'; ' + res['error'] if res['error'] else ''}")
            buckets.append(res)
        models.append({"name": name, "kind": "bert", "dtype": "f16", "buckets": buckets})
    report = {"device": {"name": "CPU backend (dry run: daemon + replayd-loadgen)"}, "kernels": "cpu",
              "models": models, "pass": not failures, "failures": failures}
    with open(out_json, "w") as f:
        json.dump(report, f, indent=1)


def parse_shapes(text):
    """"32x128,8x512" -> [(32, 128), (8, 512)]"""
    return [tuple(int(x) for x in s.split("x")) for s in text.split(",") if s]


def main(argv):
    def opt(flag, default=None):
        return argv[argv.index(flag) + 1] if flag in argv else default
    if len(argv) >= 2 and argv[0] == "make":
        layers = opt("--layers")
        which = opt("--set", "default")
        if which not in SETS:
            sys.exit(f"--set {which}: one of {', '.join(SETS)}")
        make(argv[1], int(layers) if layers else None, which)
    elif len(argv) >= 3 and argv[0] == "torch":
        torch_times(argv[1], argv[2:])
    elif len(argv) >= 6 and argv[0] == "reference":
        reference(argv[1], argv[2], int(argv[3]), int(argv[4]), int(argv[5]))
    elif len(argv) >= 3 and argv[0] == "speed-table":
        ok = speed_table(argv[1], argv[2], opt("--backend", "cuda"), parse_shapes(opt("--shapes", "32x128,8x512")),
                         float(opt("--target", "1.3")))
        sys.exit(0 if ok else 1)
    elif len(argv) >= 4 and argv[0] == "dryrun-json":
        dryrun_json(argv[1], argv[2], argv[3], parse_shapes(opt("--shapes", "8x16,2x256")),
                    float(opt("--min-cosine", "0.999")))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
