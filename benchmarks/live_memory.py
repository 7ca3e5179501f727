"""Where a training step's peak is: malloc's bytes in use beside the resident set, per phase.

`python -m benchmarks.live_memory B` runs the plain loop of `benchmarks.memory` (del loop,
batch 16) for eager PyTorch and for lazygrad's default policy, each in a fresh process (lazygrad
first fills a disk cache in a process of its own and then runs warm on it, as a user's second
run does). A thread samples the resident set and glibc's `mallinfo2` (bytes in use: what the
step holds, without the freed memory glibc keeps) every 0.5 ms; per phase of the last step
(forward, backward, optimizer) it prints both at the start, at the peak and at the end. The
resident set includes the libraries' code and glibc's free lists; the bytes in use say what the
two peers actually hold, which a whole-process peak alone cannot tell apart.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

STEPS = 4


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _sampler() -> tuple[list[tuple[float, float, float]], threading.Event]:
    """(time, resident MiB, in-use MiB) samples, taken until the event is set."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    page = os.sysconf("SC_PAGE_SIZE") / 2**20
    statm = os.open("/proc/self/statm", os.O_RDONLY)
    samples: list[tuple[float, float, float]] = []
    done = threading.Event()

    def run() -> None:
        while not done.is_set():
            info = libc.mallinfo2()
            resident = int(os.pread(statm, 64, 0).split()[1]) * page
            samples.append((time.perf_counter(), resident, (info.uordblks + info.hblkhd) / 2**20))
            time.sleep(0.0005)

    threading.Thread(target=run, daemon=True).start()
    return samples, done


def probe(workload: str, lazy: bool) -> dict:
    """The loop in this process; per phase of its last step, the samples at start, peak, end."""
    import torch

    from benchmarks.memory import WORKLOADS, _load_models

    models = _load_models()
    shape = WORKLOADS[workload]
    config = models.BertConfig(vocab=shape.vocab, hidden=shape.hidden, layers=shape.layers,
                               heads=shape.heads)
    torch.manual_seed(0)
    model = models.BertPretraining(config)
    if lazy:
        import lazygrad

        model = lazygrad.lazy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids, mlm_labels, nsp_labels = models.bert_batch(config, batch=shape.batch, seq=shape.seq)
    samples, done = _sampler()
    marks = []
    for _ in range(STEPS):
        marks.append(("forward", time.perf_counter()))
        out = model(ids, mlm_labels, nsp_labels)
        marks.append(("backward", time.perf_counter()))
        loss = torch.nn.functional.cross_entropy(out[2], nsp_labels) \
            if shape.trains == "nsp" else out[0]
        loss.backward()
        marks.append(("optimizer", time.perf_counter()))
        optimizer.step()
        optimizer.zero_grad()
        del out, loss
    marks.append(("end", time.perf_counter()))
    time.sleep(0.01)
    done.set()
    phases = {}
    for (name, start), (_, stop) in zip(marks[-4:], marks[-3:]):
        inside = [s for s in samples if start <= s[0] < stop]
        top = max(inside, key=lambda s: s[1])
        phases[name] = {"start": inside[0][1:], "peak": top[1:], "end": inside[-1][1:]}
    report = {"phases": phases}
    if lazy:
        stats = lazygrad.stats(model)
        report.update(hits=stats.hits, fallbacks=stats.fallbacks, builds=stats.builds)
    return report


def _fresh(workload: str, lazy: bool, cache: str, wait: bool) -> dict:
    env = dict(os.environ, LAZYGRAD_CACHE_DIR=cache, LAZYGRAD_WAIT_FOR_BUILDS="1" if wait else "0")
    env = {k: v for k, v in env.items() if not k.startswith("MALLOC_")}
    found = subprocess.run(
        [sys.executable, "-m", "benchmarks.live_memory", "--probe", workload, str(int(lazy))],
        capture_output=True, text=True, env=env, check=True)
    return json.loads(found.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
    if argv[:1] == ["--probe"]:  # the fresh process `_fresh` starts
        print(json.dumps(probe(argv[1], argv[2] == "1")))
        return
    from benchmarks.memory import WORKLOADS

    parser = argparse.ArgumentParser(prog="python -m benchmarks.live_memory",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", nargs="?", default="B", choices=sorted(WORKLOADS))
    workload = parser.parse_args(argv).workload
    cache = tempfile.mkdtemp(prefix="lazygrad-live-memory-")
    _fresh(workload, True, cache, wait=True)  # fills the disk cache
    rows = {"eager": _fresh(workload, False, cache, wait=False),
            "lazygrad (warm)": _fresh(workload, True, cache, wait=False)}
    print(f"workload {workload}, the last of {STEPS} steps; MiB resident / in use")
    print("| peer | phase | start | peak | end |\n| --- | --- | ---: | ---: | ---: |")
    for peer, report in rows.items():
        for phase, at in report["phases"].items():
            cells = " | ".join(f"{at[k][0]:.0f} / {at[k][1]:.0f}" for k in ("start", "peak", "end"))
            print(f"| {peer} | {phase} | {cells} |")
    lazy = rows["lazygrad (warm)"]
    print(f"lazygrad: hits {lazy['hits']}, builds {lazy['builds']}, fallbacks {lazy['fallbacks']}")


if __name__ == "__main__":
    main(sys.argv[1:])
