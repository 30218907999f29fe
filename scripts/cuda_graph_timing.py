"""Timing of PyTorch's own CUDA-graph replay, the baseline replayd is compared
with (scripts/torch_baseline.py for MiniLM and the MLP, scripts/family_models.py
for the encoder families)."""
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
