"""`python -m benchmarks.checkpointing`: activation checkpointing's saving, eager and lazygrad.

A user who turns on `gradient_checkpointing_enable()` to fit a batch expects the saving to
hold through lazygrad. Model: a Hugging Face `BertForMaskedLM` from a config (hidden 256,
intermediate 1024, 4 layers, 4 heads, vocabulary 8000, the default dropout 0.1), batch 16 x
128, AdamW, `out.loss.backward()`. Per peer (eager, lazygrad) and setting (checkpointing off,
on), one fresh process of 6 steps, default allocator; lazygrad's on a disk cache that a first
process filled (so ORT serves every step and no build runs beside them: the steady state of a
second run). Reported per process: the activations its last step saved for the backward
(saved tensors that are not parameters, lazygrad's stash included: `saved_tensors_hooks`), its
whole-process peak resident set (ru_maxrss, first step included), and its median step time.
Writes `results/checkpointing.md`. Needs the `hf` extra.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
STEPS = 6
MIB = 2**20


def probe(peer: str, checkpointing: bool) -> dict:
    """One training in this process; what it measured."""
    import resource

    import torch
    import transformers

    config = transformers.BertConfig(vocab_size=8000, hidden_size=256, intermediate_size=1024,
                                     num_hidden_layers=4, num_attention_heads=4)
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(config).train()
    if checkpointing:
        model.gradient_checkpointing_enable()
    if peer == "lazygrad":
        import lazygrad

        model = lazygrad.lazy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 8000, (16, 128), generator=torch.Generator().manual_seed(0))
    saved = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, torch.nn.Parameter):
            saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    seconds = []
    for _ in range(STEPS):
        saved[0] = 0
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        del out
        seconds.append(time.perf_counter() - start)
    found = {"saved_mib": saved[0] / MIB, "peak_mib": resource.getrusage(
        resource.RUSAGE_SELF).ru_maxrss / 1024, "step_s": statistics.median(seconds[2:])}
    if peer == "lazygrad":
        stats = lazygrad.stats(model)
        found.update(hits=stats.hits, fallbacks=stats.fallbacks, breaks=stats.breaks,
                     eager_steps=stats.eager_steps)
    return found


def run(peer: str, checkpointing: bool, cache: str) -> dict:
    """`probe` in a fresh process on the disk cache `cache`."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}
    env.update(LAZYGRAD_CACHE_DIR=cache, LAZYGRAD_WAIT_FOR_BUILDS="1")
    spec = json.dumps({"peer": peer, "checkpointing": checkpointing})
    done = subprocess.run([sys.executable, "-m", "benchmarks.checkpointing", "--probe", spec],
                          capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--probe", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.probe:
        print(json.dumps(probe(**json.loads(options.probe))))
        return 0
    started = datetime.datetime.now(datetime.timezone.utc)
    rows = []
    for checkpointing in (False, True):
        cache = tempfile.mkdtemp(prefix="lazygrad-checkpointing-")
        try:
            run("lazygrad", checkpointing, cache)  # fills the cache: the build runs here
            found = {peer: run(peer, checkpointing, cache) for peer in ("eager", "lazygrad")}
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        print(json.dumps({"checkpointing": checkpointing, **found}), flush=True)
        rows.append((checkpointing, found))
    lines = [
        "# Activation checkpointing through lazygrad (`python -m benchmarks.checkpointing`)",
        "",
        f"{started:%Y-%m-%d %H:%M} UTC, {platform.machine()}, {os.cpu_count()} cores, load "
        f"{os.getloadavg()[0]:.1f}. HF `BertForMaskedLM` (hidden 256, 4 layers, vocabulary "
        f"8000, dropout 0.1), batch 16 x 128, AdamW, {STEPS} steps per fresh process; "
        "lazygrad's on a disk cache a first process filled (ORT serves every step).",
        "",
        "| checkpointing | peer | activations saved, MiB | whole-process peak, MiB "
        "| median step, s | ORT steps, fallbacks, breaks |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    for checkpointing, found in rows:
        for peer, got in found.items():
            ort = (f"{got['hits']}, {got['fallbacks']}, {got['breaks']}" if peer == "lazygrad"
                   else "")
            lines.append(f"| {'on' if checkpointing else 'off'} | {peer} | "
                         f"{got['saved_mib']:.1f} | {got['peak_mib']:.0f} | "
                         f"{got['step_s']:.3f} | {ort} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "checkpointing.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
