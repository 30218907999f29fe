"""Timing of PyTorch's own CUDA-graph replay, the baseline replayd is compared
with. Not run by itself: a module imported by scripts/bench/torch-baseline.py
and scripts/bench/torch-graph-baseline.py (MiniLM and the MLP) and by
scripts/models/family-models.py (the encoder families); its name is
snake_case so that `import cuda_graph_timing` works."""
import statistics
import time

import torch


def replay_latency(fn, iters=2000, static_input=None):
    """Capture fn() in a CUDA graph; time replay + synchronize, per call.

    With `static_input` (the GPU tensor fn reads), also time the round trip a
    server makes: copy a pinned host batch in, replay, copy the output out to
    pinned host memory, synchronize."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    for _ in range(50):
        g.replay()
    torch.cuda.synchronize()

    def timed(step):
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            samples.append((time.perf_counter() - t0) * 1e6)
        samples.sort()
        return {
            "p50_us": statistics.median(samples),
            "p90_us": samples[int(0.9 * len(samples))],
            "p99_us": samples[int(0.99 * len(samples))],
        }

    result = timed(g.replay)
    if static_input is not None:
        host_in = static_input.detach().cpu().pin_memory()
        host_out = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)

        def round_trip():
            static_input.copy_(host_in, non_blocking=True)
            g.replay()
            host_out.copy_(out, non_blocking=True)

        result["with_copies"] = timed(round_trip)
    return result, out


def minilm_graph_latency(bert, batch, seq, iters=1000):
    """replay_latency of the MiniLM forward sentence-transformers computes
    (BertModel + mean pooling + L2 normalisation) at (batch, seq), random
    ids, with its copies (the figure of issue 10's targets 2 and 4)."""
    dev = next(bert.parameters()).device
    ids = torch.randint(1000, 20000, (batch, seq), device=dev)
    mask = torch.ones(batch, seq, dtype=torch.long, device=dev)

    def fwd():
        # BertModel.forward builds its attention mask with host-side work
        # that cannot be captured (transformers 5), so run its own embedding
        # and encoder-layer modules; the mask is all ones, so none is needed.
        h = bert.embeddings(input_ids=ids)
        for layer in bert.encoder.layer:
            h = layer(h, attention_mask=None)
            h = h[0] if isinstance(h, tuple) else h
        m = mask.unsqueeze(-1).to(h.dtype)
        e = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(e.float(), dim=-1)

    with torch.no_grad():
        r, _ = replay_latency(fwd, iters=iters, static_input=ids)
    r["rows_per_s"] = batch / r["p50_us"] * 1e6
    return r


def load_encoder(model_dir, dtype, dev="cuda"):
    """transformers' BertModel of `model_dir` in `dtype`, eager attention."""
    from transformers import AutoModel

    try:
        m = AutoModel.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
    except TypeError:  # older transformers
        m = AutoModel.from_pretrained(model_dir, torch_dtype=dtype, attn_implementation="eager")
    return m.to(dev).eval()
