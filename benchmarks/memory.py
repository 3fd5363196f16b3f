"""Child process for CPU peak memory: `python -m benchmarks.memory MODEL VARIANTS [--quick]`.

Run by run.py with MALLOC_MMAP_THRESHOLD_ set, so that freed tensors leave RSS at once and the
peak RSS of a step is its peak of live memory. Prints one JSON line {variant: MB}."""

import argparse
import json

import torch

from .run import measure_memory

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("variants")
ap.add_argument("--quick", action="store_true")
ap.add_argument("--threads", type=int)
args = ap.parse_args()
if args.threads:
    torch.set_num_threads(args.threads)
print(json.dumps(measure_memory(args.model, "cpu", args.variants.split(","), args.quick)))
