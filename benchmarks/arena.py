"""`python -m benchmarks.arena`: the whole-process peak with and without ORT's CPU arena when
grad masks and input shapes change, as they do in a real training run.

`benchmarks.memory_targets` trains one shape with one mask, where the arena costs nothing; here
the BERT-shaped model of `benchmarks/workloads.py` (batch 8) trains 3 steps of each of its three
loss compositions at sequence length 128, then 3 steps at each length 64..256 with the first.
Each configuration is a fresh process (default allocator) on a disk cache that a first process
filled, so no build runs in the measured ones; the peak (ru_maxrss) is printed after each phase.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile

LENGTHS = (64, 96, 128, 160, 192, 224, 256)
STEPS = 3


def probe(arena: bool) -> list[float]:
    """Peak MiB after each phase: the three compositions at length 128, then every length."""
    import torch

    import lazygrad
    from benchmarks.workloads import BERT, BERT_BATCH, COMPOSITIONS
    from lazygrad.examples.models import BertPretraining, bert_batch

    torch.manual_seed(0)
    model = lazygrad.lazy(BertPretraining(BERT), wait_for_builds=True, arena=arena)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    phases = [(compose, (128,)) for compose in COMPOSITIONS.values()]
    phases.append((COMPOSITIONS["loss"], LENGTHS))
    peaks = []
    for compose, lengths in phases:
        for length in lengths:
            inputs = bert_batch(BERT, batch=BERT_BATCH, seq=length)
            for _ in range(STEPS):
                compose(model(*inputs)).backward()
                optimizer.step()
                optimizer.zero_grad()
        peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    if lazygrad.stats(model).fallbacks:
        raise RuntimeError(f"a fallback: {lazygrad.stats(model)}")
    return peaks


def run(arena: bool, cache: str) -> list[float]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}
    env["LAZYGRAD_CACHE_DIR"] = cache
    done = subprocess.run([sys.executable, "-m", "benchmarks.arena", "--probe", json.dumps(arena)],
                          capture_output=True, text=True, env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    if sys.argv[1:2] == ["--probe"]:
        print(json.dumps(probe(json.loads(sys.argv[2]))))
        return
    cache = tempfile.mkdtemp(prefix="lazygrad-arena-")
    run(False, cache)  # fills the disk cache: the measured processes build nothing
    print("| ORT arena | peak MiB after: `loss` | + `loss + scores` | + all three "
          "| + lengths 64..256 |\n| --- | ---: | ---: | ---: | ---: |")
    for arena in (False, True, False, True):
        peaks = run(arena, cache)
        print(f"| {'on' if arena else 'off'} | " + " | ".join(f"{p:.0f}" for p in peaks) + " |",
              flush=True)


if __name__ == "__main__":
    main()
