#!/usr/bin/env python3
"""Issue 32's benchmark, the Python half of scripts/bench/kernels-at-scale.sh:
PyTorch's CUDA graph of BERT at three sizes, and the table that sets
replayd's `backend-check` figures beside it.

  kernels-at-scale.py torch OUT_JSON FOLDER... [--shapes 1x16,32x128,...]
                            [--impls sdpa,eager] [--budget-s 100]
      On a GPU: each folder (family-models.py make --set scale) loaded with
      transformers in f16, attn_implementation "sdpa" (what transformers
      uses by default; the headline) and then "eager" (a second column);
      its forward as sentence-transformers computes it (the encoder, mean
      pooling over the attention mask, L2 normalisation) captured in a
      torch.cuda.CUDAGraph at each padded shape (random ids, a full mask)
      and timed by scripts/bench/cuda_graph_timing.py's replay_latency:
      replay + synchronize, and the round trip with the pinned copies a
      server makes (ids in, output out; its p50 is the headline). The
      iterations follow from a first eager run (about 0.5 s a timing loop,
      20 to 1000); every SDPA timing comes before any eager one, and a
      timing is skipped (and said so) when the budget is spent. OUT_JSON is
      rewritten after every timing, so a time limit loses only the rest:
        {"torch", "transformers", "gpu",
         "results": {FOLDER_NAME: {"sdpa": {"32x128": {p50_us, p90_us,
                     p99_us, with_copies: {...}, iters, attn}, ...},
                     "eager": {...}}},
         "agreement": {FOLDER_NAME: cosine of the module path against the
                       model's own forward at the first shape},
         "cross": {"FOLDER_NAME BxS": min row cosine of the second
                   implementation's embeddings against the first's, at the
                   first two shapes (same ids)},
         "skipped": [...], "errors": [...]}

  kernels-at-scale.py table OUT_DIR
      The markdown table from what kernels-at-scale.sh leaves in OUT_DIR:
      backend-check reports bc_{new,base}_{MODEL}_{s16,s128,s512,packed}.json,
      torch.json, families.json, nvidia-smi.csv, binaries-commit.txt and
      baseline-commit.txt. Per model and shape: PyTorch SDPA and eager µs,
      replayd µs (this build and the baseline build), SDPA / replayd, this
      build against the baseline, the fraction of the dense f16 peak
      (FLOPs from the shapes), the CPU check (min cosine); then the
      profile (kernel groups at (32, 512) and (128, 128)) and the targets,
      PASS/FAIL (informative: the exit status is 0 unless the reports
      cannot be read at all). The peak: dense f16 tensor-core TFLOP/s by
      the GPU's name (H100 SXM / H200 989.4, H100 PCIe 756, A100 312), or
      PEAK_TFLOPS; NOISE (default 0.03) is how much slower than the
      baseline build a shape may be before the target says FAIL.
"""
import json
import os
import re
import sys
import time

SHAPES = [(1, 16), (32, 128), (128, 128), (8, 512), (32, 512)]
BUDGETS = [4096, 16384]
# PyTorch's side of a packed budget: its padded graph of the same tokens.
PACKED_VS = {4096: (32, 128), 16384: (128, 128)}
# Which backend-check run holds each padded shape (kernels-at-scale.sh's groups).
GROUPS = {(1, 16): "s16", (32, 128): "s128", (128, 128): "s128", (8, 512): "s512", (32, 512): "s512"}
MODEL_LABELS = {"minilm-384x6": "MiniLM", "bert-768x12": "BERT-base", "bert-1024x24": "BERT-large"}
# Dense f16 tensor-core TFLOP/s (no sparsity), by a part of the GPU's name,
# the first that matches.
PEAKS = [("H200", 989.4), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4), ("GH200", 989.4),
         ("A100", 312.0), ("L40S", 362.0), ("A10", 125.0)]


# ---------------------------------------------------------------- torch


def parse_shapes(text):
    """"32x128,8x512" -> [(32, 128), (8, 512)]"""
    return [tuple(int(x) for x in s.split("x")) for s in text.split(",") if s]


def torch_times(out_json, folders, shapes, impls, budget_s):
    import traceback

    import torch
    import transformers
    from transformers import AutoModel

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cuda_graph_timing import replay_latency

    t_end = time.monotonic() + budget_s
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    out = {"torch": torch.__version__, "transformers": transformers.__version__,
           "gpu": torch.cuda.get_device_name(0), "results": {}, "agreement": {}, "cross": {}, "skipped": [],
           "errors": []}
    first = {}

    def save():
        with open(out_json + ".tmp", "w") as f:
            json.dump(out, f, indent=1)
        os.replace(out_json + ".tmp", out_json)

    def load(folder, impl):
        try:
            m = AutoModel.from_pretrained(folder, dtype=torch.float16, attn_implementation=impl)
        except TypeError:  # older transformers
            m = AutoModel.from_pretrained(folder, torch_dtype=torch.float16, attn_implementation=impl)
        # f16 whatever the keyword did (an older transformers may take
        # `dtype` for a config attribute and load f32).
        return m.to(device=dev, dtype=torch.float16).eval()

    # The headline (SDPA) for every folder before the second column.
    for impl in impls:
        for folder in folders:
            name = os.path.basename(os.path.normpath(folder))
            if time.monotonic() > t_end:
                out["skipped"].append(f"{name} {impl}: all shapes (budget of {budget_s:.0f} s spent)")
                continue
            try:
                model = load(folder, impl)
            except Exception:
                traceback.print_exc()
                out["errors"].append(f"{name} {impl}: load: {traceback.format_exc(limit=2)}")
                save()
                continue
            attn = getattr(model.config, "_attn_implementation", None)
            vocab = model.config.vocab_size
            res = out["results"].setdefault(name, {}).setdefault(impl, {})
            for i, (b, s) in enumerate(shapes):
                key = f"{b}x{s}"
                if time.monotonic() > t_end:
                    out["skipped"].append(f"{name} {impl} {key} (budget spent)")
                    continue
                gen = torch.Generator(device=dev).manual_seed(1000 * b + s)
                ids = torch.randint(5, vocab - 1, (b, s), device=dev, generator=gen)
                mask = torch.ones(b, s, dtype=torch.long, device=dev)

                def fwd():
                    # The model's own embedding and layer modules: its forward
                    # builds the attention mask with host-side work that a
                    # graph cannot capture (as cuda_graph_timing.py notes);
                    # the mask is all ones, so none is needed, and SDPA runs
                    # without one (its fastest kernel).
                    h = model.embeddings(input_ids=ids)
                    for layer in model.encoder.layer:
                        h = layer(h, attention_mask=None)
                        h = h[0] if isinstance(h, tuple) else h
                    m = mask.unsqueeze(-1).to(h.dtype)
                    e = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
                    return torch.nn.functional.normalize(e.float(), dim=-1)

                try:
                    with torch.no_grad():
                        if i == 0 and impl == impls[0]:
                            # The module path computes what the model's forward does.
                            want = model(input_ids=ids, attention_mask=mask).last_hidden_state
                            m = mask.unsqueeze(-1).to(want.dtype)
                            want = torch.nn.functional.normalize(((want * m).sum(1) / m.sum(1)).float(), dim=-1)
                            out["agreement"][name] = torch.nn.functional.cosine_similarity(
                                fwd().flatten(), want.flatten(), dim=0).item()
                        if i < 2:
                            # SDPA's rows against eager attention's on the same
                            # ids: the same non-causal attention (the module
                            # path passes no mask).
                            got = fwd().float().cpu()
                            if impl == impls[0]:
                                first[(name, key)] = got
                            elif (name, key) in first:
                                cos = torch.nn.functional.cosine_similarity(got, first[(name, key)], dim=-1)
                                out["cross"][f"{name} {key}"] = cos.min().item()
                        # A first eager run sets the iterations: ~0.5 s a loop.
                        fwd()
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        fwd()
                        torch.cuda.synchronize()
                        est = time.perf_counter() - t0
                        iters = int(min(1000, max(20, 0.5 / max(est, 1e-6))))
                        r, _ = replay_latency(fwd, iters=iters, static_input=ids)
                    r.update(iters=iters, attn=attn, eager_first_us=est * 1e6,
                             dtype=str(next(model.parameters()).dtype))
                    res[key] = r
                    print(f"{name} {impl} {key}: {json.dumps(r)}", flush=True)
                except Exception:
                    traceback.print_exc()
                    out["errors"].append(f"{name} {impl} {key}: {traceback.format_exc(limit=3)}")
                save()
            del model
            torch.cuda.empty_cache()
    save()


# ---------------------------------------------------------------- table


def load_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except Exception:
        return None


def read(path, default=""):
    try:
        with open(path) as f:
            return f.read().strip()
    except Exception:
        return default


def peak_tflops(gpu_name):
    env = os.environ.get("PEAK_TFLOPS")
    if env:
        return float(env), "PEAK_TFLOPS"
    for part, tf in PEAKS:
        if part.lower() in (gpu_name or "").lower():
            return tf, f"by name ({part})"
    return None, "unknown GPU: set PEAK_TFLOPS"


def fill_len_moments(max_len):
    """E[len] and E[len²] of backend-check's packed `fill` lengths
    (src/tools/backend_check/packed.rs): three in four uniform in
    [1, min(64, max_len)], the rest uniform in [1, max_len]; the last one
    cut to the budget is left out."""
    def uni(n):
        return (n + 1) / 2, (n + 1) * (2 * n + 1) / 6
    a1, a2 = uni(min(64, max_len))
    b1, b2 = uni(max_len)
    return 0.75 * a1 + 0.25 * b1, 0.75 * a2 + 0.25 * b2


def linear_flops(d, tokens):
    """Matmul FLOPs of the Linears of every layer: 2·T·(4H² + 2·H·I)."""
    h, i = d["hidden"], d["intermediate"]
    return d["layers"] * 2 * tokens * (4 * h * h + 2 * h * i)


def attention_flops(d, sum_sq):
    """Scores and values of every layer: 4·Σ(len²)·H (padded: B·S²)."""
    return d["layers"] * 4 * sum_sq * d["hidden"]


def padded_flops(d, b, s):
    return linear_flops(d, b * s) + attention_flops(d, b * s * s)


def packed_flops(d, tokens, max_len):
    m1, m2 = fill_len_moments(max_len)
    return linear_flops(d, tokens) + attention_flops(d, tokens * m2 / m1)


def bucket_of(report, model, label):
    """The served run of bucket `label` ("32x128", "4096t") of `model`."""
    for m in (report or {}).get("models", []):
        if m.get("name") != model:
            continue
        cands = [b for b in m.get("buckets", []) if b.get("bucket") == label]
        cands.sort(key=lambda b: not b.get("served", True))
        if cands:
            return cands[0]
    return None


def p50(b):
    v = ((b or {}).get("latency") or {}).get("median_us")
    return v if v else None


def check_cell(b):
    if b is None:
        return "missing"
    c = b.get("check") or {}
    if b.get("error"):
        return f"ERROR {b['error'][:60]}"
    if not c:
        return "no check"
    v = c.get("value")
    word = "ok" if c.get("pass") else "FAIL"
    if c.get("metric") == "min_cosine" and v is not None:
        return f"{v:.6f} {word}"
    return f"{c.get('metric')} {v} {word}"


def fmt(v, spec=".1f", none="n/a"):
    return none if v is None else format(v, spec)


# Kernel groups of the profile, by the step's name (launch.rs's label:
# "name grid AxBxC" for kernels, "cublasLt ..." for matmuls), first match.
KERNEL_GROUPS = [
    ("matmuls", ("cublasLt", "gemm_small", "skinny", "ffn")),
    ("attention", ("attention",)),
    ("pooling", ("pool", "l2norm")),
    ("bias + GELU", ("bias_act", "gated")),
    ("LayerNorm (+ residual)", ("add_ln", "ln_rows", "layernorm", "ln_", "add_rows")),
    ("embedding (+ LayerNorm)", ("embed",)),
    ("staging", ("stage_",)),
]


def group_of(label):
    for g, prefixes in KERNEL_GROUPS:
        if any(label.startswith(p) for p in prefixes):
            return g
    return "other"


def profile_groups(steps):
    """{group: (steps, µs)} and the total µs of a backend-check profile."""
    groups = {}
    for label, us in steps:
        g = groups.setdefault(group_of(label), [0, 0.0])
        g[0] += 1
        g[1] += us
    return groups, sum(us for _, us in steps)


def cublas_flops(steps):
    """2·m·n·k of the cuBLASLt steps whose label names their shape."""
    total = 0
    for label, _ in steps:
        m = re.match(r"cublasLt \S+ m(\d+) n(\d+) k(\d+)", label)
        if m:
            total += 2 * int(m.group(1)) * int(m.group(2)) * int(m.group(3))
    return total


def profile_summary(steps):
    """Steps grouped by kernel name (the grid left off; matmuls by shape),
    largest total first, as report.rs's profile_summary does."""
    groups = {}
    for label, us in steps:
        key = label.split(" grid ")[0]
        g = groups.setdefault(key, [0, 0.0])
        g[0] += 1
        g[1] += us
    return sorted(groups.items(), key=lambda kv: -kv[1][1])


def table(out_dir):
    P = lambda f: os.path.join(out_dir, f)
    fams = load_json(P("families.json")) or {}
    tj = load_json(P("torch.json")) or {}
    tres = tj.get("results") or {}
    smi = read(P("nvidia-smi.csv"))
    gpu_name, driver = "", ""
    rows = [r for r in smi.splitlines() if r.strip()]
    if len(rows) >= 2:
        hdr = [h.strip() for h in rows[0].split(",")]
        val = [v.strip() for v in rows[1].split(",")]
        d = dict(zip(hdr, val))
        gpu_name = next((v for k, v in d.items() if k.startswith("name")), "")
        driver = next((v for k, v in d.items() if k.startswith("driver")), "")
    reports = {}
    for f in sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []:
        m = re.match(r"bc_(new|base|tuned)_(.+)_(s16|s128|s512|packed)\.json$", f)
        if m:
            reports[(m.group(1), m.group(2), m.group(3))] = load_json(P(f))
    if not gpu_name:
        gpu_name = next((r["device"]["name"] for r in reports.values() if r and r.get("device")), "?")
    peak, peak_src = peak_tflops(gpu_name)
    has_base = any(k[0] == "base" for k in reports)
    noise = float(os.environ.get("NOISE", "0.03"))
    commit = read(P("binaries-commit.txt"), "?").replace("\n", " ")
    base_commit = read(P("baseline-commit.txt"), "none" if not has_base else "?").replace("\n", " ")
    kernels = next((r.get("kernels") for (w, _, _), r in reports.items() if w == "new" and r), "?")

    print("# replayd kernels at scale against PyTorch's CUDA graph (issue 32)\n")
    threads = next((r.get("cpu_threads") for r in reports.values() if r and r.get("cpu_threads")), None)
    print(f"* machine: {gpu_name or '?'}, driver {driver or '?'}; {os.cpu_count()} CPUs "
          f"(the CPU reference check ran on {threads or '?'} threads)")
    print(f"* replayd: this build {commit} (kernels {kernels}); baseline build {base_commit}")
    loaded = sorted({f"{impl} → {r.get('attn')} ({r.get('dtype', '?')})" for m in tres.values()
                     for impl, shapes in m.items() for r in shapes.values()})
    print(f"* PyTorch {tj.get('torch', '?')}, transformers {tj.get('transformers', '?')} on {tj.get('gpu', '?')}; "
          f"attention as loaded: {', '.join(loaded) or '?'}")
    print(f"* dense f16 peak: {fmt(peak, '.1f')} TFLOP/s ({peak_src})\n")
    print("replayd µs: `replayd backend-check` launch → collect of a random batch in the bucket's CUDA graph, "
          "pinned copies in and out included, p50; the served kernel paths (`--no-compare`). PyTorch µs: the "
          "same forward (encoder, mean pooling over the mask, L2 normalisation) captured in a "
          "torch.cuda.CUDAGraph, replayed with the same copies (ids in, embeddings out), p50 "
          "(scripts/bench/cuda_graph_timing.py); SDPA is the headline, eager attention a second column. "
          "× SDPA = PyTorch SDPA µs / replayd µs (above 1: replayd faster). vs base = this build's µs against "
          "the baseline build's, same run (negative: faster). % peak = FLOPs from the shapes / µs / peak. "
          "check: the CPU backend on the same rows (min cosine; padded buckets: `--check-rows` rows, packed: "
          "every row of four batches).\n")
    print("Notes:\n")
    print("* FLOPs (2 a multiply-add): per layer 2·T·(4H² + 2·H·I) for the Linears and 4·Σ(len²)·H for the "
          "attention scores and values; padded buckets count every slot, T = B·S and Σ(len²) = B·S² (what a "
          "dense kernel computes). Embeddings, LayerNorms, activations and pooling are left out.")
    print("* backend-check's padded batches have random lengths in [2, S] (the rest masked) while PyTorch's rows "
          "are full: the work is the same for kernels that compute masked slots; an attention kernel that skips "
          "masked key blocks does less than counted, so its % peak and TFLOP/s overstate it.")
    print("* packed budgets: PyTorch's column is its padded graph of the same token count, (32, 128) for 4,096 "
          "and (128, 128) for 16,384 (marked \\*). replayd times random `fill` batches (lengths 1–64 three times "
          "in four, else 1 to the longest; src/tools/backend_check/packed.rs) that fill the budget; the JSON "
          "does not record their lengths, so the FLOPs count the budget's tokens with Σ(len²) = T·E[len²]/E[len] "
          "of that distribution (an approximation).")
    print("* the profile is `backend-check --profile`: each step of one batch timed alone (mean GPU µs of 20 "
          "runs, steps back to back, outside the graph), so its total is not the replay's time.\n")

    head = ("| model | shape | PyTorch SDPA µs | PyTorch eager µs | replayd µs | baseline µs | × SDPA | × eager "
            "| vs base | % peak replayd | % peak SDPA | check (min cos) | baseline check |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    ratios, slower, base_cmp, check_fail, missing = {}, [], [], [], []
    for name, d in fams.items():
        label = MODEL_LABELS.get(name, name)
        t_model = tres.get(name) or {}
        entries = [((b, s), f"{b}x{s}", GROUPS[(b, s)], name, (b, s)) for b, s in SHAPES]
        entries += [(t, f"{t}t", "packed", f"{name}-packed", PACKED_VS[t]) for t in BUDGETS]
        for key, blabel, group, mname, tshape in entries:
            new = bucket_of(reports.get(("new", name, group)), mname, blabel)
            base = bucket_of(reports.get(("base", name, group)), mname, blabel)
            tk = f"{tshape[0]}x{tshape[1]}"
            ts = ((t_model.get("sdpa") or {}).get(tk) or {}).get("with_copies", {}).get("p50_us")
            te = ((t_model.get("eager") or {}).get(tk) or {}).get("with_copies", {}).get("p50_us")
            un, ub = p50(new), p50(base)
            if isinstance(key, tuple):
                fl = padded_flops(d, *key)
                shape = f"({key[0]}, {key[1]})"
                tfl = fl
            else:
                max_len = (new or base or {}).get("seq") or 512
                fl = packed_flops(d, key, max_len)
                shape = f"packed {key:,} t"
                tfl = padded_flops(d, *tshape)
            star = "\\*" if not isinstance(key, tuple) else ""
            r_s = ts / un if ts and un else None
            r_e = te / un if te and un else None
            ratios[(name, key)] = r_s
            chg = (un / ub - 1) * 100 if un and ub else None
            if chg is not None:
                base_cmp.append((f"{label} {shape}", chg))
                if chg > noise * 100:
                    slower.append(f"{label} {shape} {chg:+.1f} %")
            if new is None or un is None:
                missing.append(f"{label} {shape}")
            if new is not None and (new.get("error") or not (new.get("check") or {}).get("pass")):
                check_fail.append(f"{label} {shape}")
            pk = lambda us, f: None if not us or not peak else f / (us * 1e-6) / (peak * 1e12) * 100
            cells = [label, shape, fmt(ts) + star if ts else "n/a", fmt(te) + star if te else "n/a", fmt(un),
                     fmt(ub) if has_base else "—", fmt(r_s, ".2f") + "×" if r_s else "n/a",
                     fmt(r_e, ".2f") + "×" if r_e else "n/a",
                     (f"{chg:+.1f} %" if chg is not None else "n/a") if has_base else "—",
                     fmt(pk(un, fl), ".1f") + " %" if pk(un, fl) is not None else "n/a",
                     fmt(pk(ts, tfl), ".1f") + " %" if pk(ts, tfl) is not None else "n/a",
                     check_cell(new), check_cell(base) if has_base else "—"]
            print("| " + " | ".join(cells) + " |")
    print()
    if tj.get("agreement"):
        print("PyTorch's module path against the model's own forward (cosine): " + ", ".join(
            f"{k} {v:.6f}" for k, v in tj["agreement"].items()) + "\n")
    if tj.get("cross"):
        print("PyTorch eager against SDPA, same ids (min row cosine; far below 1 would mean SDPA did not "
              "compute BERT's attention): " + ", ".join(f"{k} {v:.6f}" for k, v in tj["cross"].items()) + "\n")
    for k in ("skipped", "errors"):
        if tj.get(k):
            print(f"PyTorch {k}:\n")
            for e in tj[k][:20]:
                print(f"* {e.splitlines()[0] if e else e}")
            print()

    # ---- profile
    print("## Profile (`backend-check --profile`; the baseline build's beside it)\n")
    attn_tf, pool_us = {}, {}
    order = ["bert-768x12"] + [n for n in fams if n != "bert-768x12"]
    for name in order:
        d = fams.get(name)
        if not d:
            continue
        label = MODEL_LABELS.get(name, name)
        for b, s in [(32, 512), (128, 128)]:
            bk = bucket_of(reports.get(("new", name, GROUPS[(b, s)])), name, f"{b}x{s}")
            steps = [tuple(x) for x in (bk or {}).get("profile") or []]
            if not steps:
                print(f"* {label} ({b}, {s}): no profile\n")
                continue
            groups, total = profile_groups(steps)
            bb = bucket_of(reports.get(("base", name, GROUPS[(b, s)])), name, f"{b}x{s}")
            base_steps = [tuple(x) for x in (bb or {}).get("profile") or []]
            base_groups, base_total = profile_groups(base_steps)
            us = lambda g: groups.get(g, [0, 0.0])[1]
            a_us, m_us = us("attention"), us("matmuls")
            a_tf = attention_flops(d, b * s * s) / (a_us * 1e-6) / 1e12 if a_us else None
            m_tf = linear_flops(d, b * s) / (m_us * 1e-6) / 1e12 if m_us else None
            cb = cublas_flops(steps)
            if (b, s) == (32, 512):
                attn_tf[name] = (a_tf, d["hidden"] // d["heads"])
                pool_us[name] = us("pooling")
            print(f"### {label} ({b}, {s}): {total:.1f} µs of GPU time in {len(steps)} steps "
                  f"(replay with copies {fmt(p50(bk))} µs)"
                  + (f"; the baseline build {base_total:.1f} µs in {len(base_steps)} steps" if base_steps else "")
                  + "\n")
            print("| kernels | steps | µs | share | TFLOP/s | % peak | baseline steps | baseline µs |")
            print("|---|---|---|---|---|---|---|---|")
            for g, _ in KERNEL_GROUPS + [("other", ())]:
                if g not in groups and g not in base_groups:
                    continue
                n, t = groups.get(g, [0, 0.0])
                bn, bt = base_groups.get(g, [0, 0.0])
                tf = a_tf if g == "attention" else m_tf if g == "matmuls" else None
                pct = f"{tf / peak * 100:.1f} %" if tf and peak else ""
                base_cols = f"{bn} | {bt:.1f}" if base_steps else " | "
                print(f"| {g} | {n} | {t:.1f} | {t / total * 100:.1f} % | {fmt(tf, '.1f', '')} | {pct} | {base_cols} |")
            print()
            print(f"Attention: {attention_flops(d, b * s * s) / 1e9:.1f} GFLOP (4·B·S²·H × {d['layers']} layers, "
                  f"head dim {d['hidden'] // d['heads']}); matmuls: {linear_flops(d, b * s) / 1e9:.1f} GFLOP from "
                  f"the shapes" + (f" ({cb / 1e9:.1f} GFLOP in the cuBLASLt steps' own shapes)" if cb else "")
                  + ".\n")
            print("<details><summary>every kernel</summary>\n")
            for k, (n, t) in profile_summary(steps):
                print(f"* {k} {n}× {t / n:.1f} µs ({t:.1f})")
            print("\n</details>\n")

    # ---- matmul_autotune
    tuned = [(k, v) for k, v in reports.items() if k[0] == "tuned"]
    if tuned:
        print("## BERT-base with `matmul_autotune = true` (this build)\n")
        print("| shape | heuristic µs | tuned µs | change |")
        print("|---|---|---|---|")
        for (_, name, group), rep in sorted(tuned):
            for (b, s_), g in GROUPS.items():
                if g != group:
                    continue
                t = p50(bucket_of(rep, name, f"{b}x{s_}"))
                h = p50(bucket_of(reports.get(("new", name, group)), name, f"{b}x{s_}"))
                ch = f"{(t / h - 1) * 100:+.1f} %" if t and h else "n/a"
                print(f"| ({b}, {s_}) | {fmt(h)} | {fmt(t)} | {ch} |")
        print()

    # ---- targets
    print("## Targets (informative)\n")
    verdicts = []

    def target(what, value, ok, detail=""):
        word = "n/a (not measured)" if value is None else ("PASS" if ok else "FAIL")
        verdicts.append(word)
        print(f"* {what}: {detail or fmt(value, '.2f')} — {word}")

    r = ratios.get(("minilm-384x6", (128, 128)))
    x = lambda v: "n/a" if v is None else f"{v:.2f}×"
    target("MiniLM (128, 128) ≥ 2.0× PyTorch SDPA", r, r is not None and r >= 2.0, x(r))
    r = ratios.get(("bert-768x12", (128, 128)))
    target("BERT-base (128, 128) ≥ 1.5×", r, r is not None and r >= 1.5, x(r))
    d = fams.get("bert-768x12")
    bk = bucket_of(reports.get(("new", "bert-768x12", "s128")), "bert-768x12", "128x128")
    frac = (padded_flops(d, 128, 128) / (p50(bk) * 1e-6) / (peak * 1e12) * 100
            if d and p50(bk) and peak else None)
    target("BERT-base (128, 128) ≥ 55 % of the dense f16 peak", frac, frac is not None and frac >= 55,
           "n/a" if frac is None else f"{frac:.1f} %")
    r = ratios.get(("bert-768x12", (32, 512)))
    target("BERT-base (32, 512) ≥ 1.5×", r, r is not None and r >= 1.5, x(r))
    r = ratios.get(("bert-1024x24", (32, 512)))
    target("BERT-large (32, 512) ≥ 1.4×", r, r is not None and r >= 1.4, x(r))
    hd64 = {n: v for n, (v, hd) in attn_tf.items() if hd == 64 and v is not None}
    lo = min(hd64.values()) if hd64 else None
    target("attention at (32, 512), head dim 64, ≥ 350 TFLOP/s (the profile)", lo, lo is not None and lo >= 350,
           ", ".join(f"{MODEL_LABELS.get(n, n)} {v:.1f}" for n, v in hd64.items()) or "n/a")
    others = {n: v for n, (v, hd) in attn_tf.items() if hd != 64 and v is not None}
    if others:
        print("  (head dim 32, not gated: " + ", ".join(f"{MODEL_LABELS.get(n, n)} {v:.1f} TFLOP/s"
                                                      for n, v in others.items()) + ")")
    pools = {n: v for n, v in pool_us.items() if v}
    hi = max(pools.values()) if pools else None
    target("pooling at (32, 512) ≤ 15 µs (the profile)", hi, hi is not None and hi <= 15,
           ", ".join(f"{MODEL_LABELS.get(n, n)} {v:.1f} µs" for n, v in pools.items()) or "n/a")
    if has_base and base_cmp:
        worst = max(base_cmp, key=lambda x: x[1])
        n_all = len(fams) * (len(SHAPES) + len(BUDGETS))
        detail = (f"{len(base_cmp)} of {n_all} shapes compared; slowest change {worst[0]} {worst[1]:+.1f} %"
                  + (f"; slower than the baseline by more than {noise * 100:.0f} %: {', '.join(slower)}"
                     if slower else ""))
        target(f"no shape slower than the baseline build ({base_commit}; noise {noise * 100:.0f} %)",
               worst[1], not slower, detail)
    else:
        target("no shape slower than the baseline build", None, False, "no baseline build in this run")
    if check_fail:
        print(f"\nCPU check FAILED or missing: {', '.join(check_fail)}")
    if missing:
        print(f"\nNot measured (replayd, this build): {', '.join(missing)}")
    print()
    print("RESULT:", "PASS" if all(v == "PASS" for v in verdicts) and not check_fail and not missing else "FAIL",
          "(informative)")
    return True


def main(argv):
    def opt(flag, default=None):
        return argv[argv.index(flag) + 1] if flag in argv else default
    pos = []
    skip = False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a.startswith("--"):
            skip = True
            continue
        pos.append(a)
    if len(pos) >= 3 and pos[0] == "torch":
        torch_times(pos[1], pos[2:], parse_shapes(opt("--shapes", ",".join(f"{b}x{s}" for b, s in SHAPES))),
                    opt("--impls", "sdpa,eager").split(","), float(opt("--budget-s", "100")))
    elif len(pos) == 2 and pos[0] == "table":
        table(pos[1])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
