"""Peak memory of a training step per stash policy, against eager PyTorch.

`python -m benchmarks.memory [--quick]`. The model is BERT-shaped with a large MLM head (vocab
30k) whose output gets no gradient: only the NSP-style loss is trained. That is the case a
mask-specialised backward exists for: "all" (ORTModule's pessimistic graph) stashes what the MLM
head's backward would read, "predict" stashes only what the NSP backward reads.

Each configuration runs in a fresh subprocess, so no allocator state leaks between them. After
warm-up steps (export, graph builds) the process's high-water mark is reset
(`/proc/self/clear_refs` = 5) and the peak resident set (VmHWM) of the measured steps is read.
Reported: that peak, and the peak minus the resident set just before the step (what the step
itself adds: activations, stash, gradients). glibc is told to return large blocks to the system
at once (MALLOC_MMAP_THRESHOLD_), so the resident set follows live memory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CONFIGS = ("eager", "lazygrad-all", "lazygrad-predict", "lazygrad-recompute")
RESULTS = Path(__file__).parent / "results"


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(config: str, quick: bool) -> dict:
    """Run in the subprocess: warm up, reset the high-water mark, measure training steps."""
    import torch

    import lazygrad
    from lazygrad.examples.models import BertConfig, BertPretraining, bert_batch

    torch.manual_seed(0)
    torch.set_num_threads(2)
    shape = (
        BertConfig(vocab=30000, hidden=128, layers=2, heads=4)
        if quick
        else BertConfig(vocab=30000, hidden=256, layers=4, heads=4)
    )
    batch = bert_batch(shape, batch=8, seq=64 if quick else 128)
    model = BertPretraining(shape)
    if config != "eager":
        model = lazygrad.lazy(model, policy=config.split("-")[1])
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        _, _, nsp = model(*batch)
        torch.nn.functional.cross_entropy(nsp, batch[2]).backward()
        optimizer.step()

    for _ in range(3):
        step()
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    for _ in range(2 if quick else 3):
        step()
    peak = _status_kib("VmHWM")
    result = {"config": config, "peak_mib": peak / 1024, "step_mib": (peak - before) / 1024}
    if config != "eager":
        stats = lazygrad.stats(model)
        result.update(builds=stats.builds, recomputes=stats.recomputes)
    return result


def run_all(quick: bool) -> list[dict]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", LAZYGRAD_CACHE_DIR="")
    results = []
    for config in CONFIGS:
        print(f"measuring {config} in a fresh process ...", flush=True)
        command = [sys.executable, "-m", "benchmarks.memory", "--one", config]
        if quick:
            command.append("--quick")
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, check=True,
            cwd=Path(__file__).parent.parent,
        )
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return results


def table(results: list[dict]) -> str:
    by_name = {r["config"]: r for r in results}
    rows = [
        "| configuration | peak RSS MiB | added by the step MiB | vs eager (step) "
        "| vs all (step) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        rows.append(
            f"| {r['config']} | {r['peak_mib']:.0f} | {r['step_mib']:.0f} | "
            f"{r['step_mib'] / by_name['eager']['step_mib']:.2f}x | "
            f"{r['step_mib'] / by_name['lazygrad-all']['step_mib']:.2f}x |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer steps")
    parser.add_argument("--one", choices=CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one, args.quick)))
        return
    text = table(run_all(args.quick))
    print(text)
    RESULTS.mkdir(exist_ok=True)
    name = "memory-quick.md" if args.quick else "memory.md"
    (RESULTS / name).write_text(__doc__.split("\n\n")[1] + "\n\n" + text + "\n")


if __name__ == "__main__":
    main()
