#!/usr/bin/env python3
"""PyTorch's own CUDA-graph replay of MiniLM in f16 at the shapes of issue
10's targets 2 and 4, for scripts/bench/bench-host.sh to set beside replayd's
(the same forward scripts/bench/torch-baseline.py times for the GPU check).

Usage: torch-graph-baseline.py MODEL_DIR OUT_JSON [BxS ...]   (default 1x16 128x128)
Writes {"minilm_f16_1x16": {"p50_us": .., "with_copies": {"p50_us": ..}}, ...}.
"""
import json
import sys

import torch

from cuda_graph_timing import load_encoder, minilm_graph_latency

model_dir, out_json = sys.argv[1:3]
shapes = [tuple(int(v) for v in s.split("x")) for s in (sys.argv[3:] or ["1x16", "128x128"])]
torch.backends.cuda.matmul.allow_tf32 = False
results = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
bert = load_encoder(model_dir, torch.float16)
for b, s in shapes:
    results[f"minilm_f16_{b}x{s}"] = minilm_graph_latency(bert, b, s)
json.dump(results, open(out_json, "w"), indent=1)
print(json.dumps(results, indent=1))
