"""Memory as a user measures it: the whole-process peak of a plain training loop, per stash policy.

`python -m benchmarks.memory [--quick]` writes `results/memory.md` and `results/memory.json`
(`--quick`: `memory-quick.*`). Every figure comes from a fresh process, started from nothing
(python, `import torch`, the model, AdamW, a handful of steps), with the default allocator (no
MALLOC_* variable) and an empty, private lazygrad disk cache (`LAZYGRAD_CACHE_DIR`), so that the
first step pays the graph build as it does for a new user.

- Whole-process peak: the kernel's high-water mark of the resident set (VmHWM, what getrusage
  reports as ru_maxrss) over the whole process, first step included. The process reads VmHWM at
  named points (after each import, after each step) and resets it after reading, so each point
  also tells the peak since the previous one; the whole-process peak is the largest of these,
  which is the high-water mark of the run as if it had never been reset.
- Two loops: "keep" (`out = model(...)`: the previous step's outputs stay referenced while the
  next step runs) and "del" (`del out` after each step).
- Largest batch within a budget: the budget is eager's peak at batch 16 ("keep" loop); each
  peer's batch is bisected, every probe a fresh process run under that budget as a hard limit (a
  cgroup-v1 memory group made under this process's own, where one can be made; otherwise the
  probe's whole-process peak is compared with the budget, and the report says so).
- Workload A: BERT-shaped, vocabulary 30,000, hidden 256, 2 layers, batch 16, seq 128; the model
  returns (loss, scores, NSP logits) and only the NSP loss is backwarded, so the big vocabulary
  head gets no gradient. Workload B: 8 layers, vocabulary 8,000, `loss.backward()`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path

# Only the standard library at module level: a probe process measures its own imports.

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CONFIGS = ("eager", "all", "predict", "recompute")  # lazygrad's policies; "predict" is default
DEFAULT = "predict"
LAYERS = "predict+layers"  # the default policy with layer-wise recomputation (probe_train)
LOOPS = ("keep", "del")
MIB = 2**20
MAX_STEPS = 40  # a lazy loop's steps at most (see `probe_train`)


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    title: str
    vocab: int
    hidden: int
    layers: int
    heads: int
    batch: int
    seq: int
    trains: str  # "nsp": only F.cross_entropy(nsp_logits, nsp_labels); "loss": the model's loss


WORKLOADS = {
    "A": Workload("A", "BERT-shaped, NSP loss only", 30000, 256, 2, 4, 16, 128, "nsp"),
    "B": Workload("B", "deep (8 layers), loss.backward()", 8000, 256, 8, 4, 16, 128, "loss"),
}


@dataclasses.dataclass(frozen=True)
class Plan:
    """How much a run measures; `--quick` trades workload B, steps and probes for time."""

    workloads: tuple[str, ...]
    loops: tuple[str, ...]
    steps: int  # training steps per process: the first pays the build, the last is steady
    low: int  # a batch assumed to fit (0: none)
    high: int  # a batch assumed not to fit
    probes: int  # at most, per peer and workload
    staged: tuple[str, ...]  # configs whose build stages a diagnostic run marks


FULL = Plan(("A", "B"), LOOPS, steps=4, low=0, high=64, probes=6, staged=("all", DEFAULT))
QUICK = Plan(("A",), ("keep",), steps=3, low=0, high=32, probes=2, staged=(DEFAULT,))


# ---------------------------------------------------------------- inside a probe process


def _status_mib() -> dict[str, float]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            fields[key] = int(value.split()[0]) / 1024
    return fields


class Timeline:
    """Resident memory at named points of a run, and the peak since the previous point."""

    def __init__(self) -> None:
        self.points: list[dict] = []

    def mark(self, name: str) -> None:
        status = _status_mib()
        self.points.append(
            {"at": name, "rss": status["VmRSS"], "anon": status["RssAnon"],
             "peak": status["VmHWM"]}
        )
        # The high-water mark starts again from the current resident set; the peak of the
        # whole run is the largest of the points' peaks.
        Path("/proc/self/clear_refs").write_text("5")


def _load_models():
    """lazygrad/examples/models.py, loaded as a file: importing it as a package module would run
    lazygrad/__init__ (ORT, onnx, onnxscript, the exporter), which an eager user never pays."""
    name = "_benchmark_models"
    spec = importlib.util.spec_from_file_location(name, ROOT / "lazygrad/examples/models.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def probe_imports() -> dict:
    """What each import adds to the resident set of a fresh process (no model, no step)."""
    timeline = Timeline()
    timeline.mark("python")
    import torch  # noqa: F401

    timeline.mark("import torch")
    import onnxruntime  # noqa: F401

    timeline.mark("import onnxruntime")
    import onnx  # noqa: F401

    timeline.mark("import onnx")
    import onnxscript  # noqa: F401

    timeline.mark("import onnxscript")
    import torch.onnx  # noqa: F401

    timeline.mark("import torch.onnx")
    import lazygrad  # noqa: F401

    timeline.mark("import lazygrad")
    return {"timeline": timeline.points}


def _mark_build_stages(timeline: Timeline) -> None:
    """Diagnostic runs only: marks around the build's stages, by wrapping the names lazygrad's
    runtime calls them by (capture: trace and partition; export: to ONNX; verify: sessions made
    and the new pair run once against its FX graphs)."""
    from lazygrad import runtime

    def around(name: str, stage: Callable) -> Callable:
        def marked(*args, **kwargs):
            if name == "capture":
                timeline.mark("build starts")
            result = stage(*args, **kwargs)
            timeline.mark(f"after {name}")
            return result

        return marked

    for name in ("capture", "export", "verify"):
        setattr(runtime, name, around(name, getattr(runtime, name)))


def probe_train(
    workload: str, config: str, loop: str, batch: int, steps: int, stages: bool = False,
    segments: int | None = None, then_batch: int | None = None,
) -> dict:
    """A plain training loop, as a user writes it, with the timeline of its resident set;
    `stages`: also mark the build's stages (a diagnostic run, not a figure of the tables);
    `segments`: lazygrad's backward segments (None: its default); `then_batch`: one more step
    at that batch size, its graphs built before the process ends (a run that fills the disk
    cache for later processes at other batch sizes: lazygrad makes the batch size a symbol
    where it changed, and the index keeps it so)."""
    timeline = Timeline()
    timeline.mark("python")
    import torch
    import torch.nn.functional as F

    timeline.mark("import torch")
    models = _load_models()
    lazy = config != "eager"
    if lazy:
        import lazygrad

        timeline.mark("import lazygrad")
        if stages:
            _mark_build_stages(timeline)
    shape = WORKLOADS[workload]
    bert = models.BertConfig(
        vocab=shape.vocab, hidden=shape.hidden, layers=shape.layers, heads=shape.heads
    )
    torch.manual_seed(0)
    model = models.BertPretraining(bert)
    if lazy:
        policy, recompute_layers = lazy_options(config)
        model = lazygrad.lazy(model, policy=policy, recompute_layers=recompute_layers,
                              **({} if segments is None else {"segments": segments}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids, mlm_labels, nsp_labels = models.bert_batch(bert, batch=batch, seq=shape.seq)
    timeline.mark("model, optimizer, batch")

    seconds, served = [], []
    out = None
    index = 0
    # Tiered execution: a lazy model's first steps run eagerly while its graphs are built in
    # the background, so a lazy loop runs on until its graphs have served `steps - 1` steps
    # (at most MAX_STEPS): the build, the steps beside it and steady steps are all measured.
    while index < steps or (lazy and served[-1] < steps - 1 and index < MAX_STEPS):
        start = time.perf_counter()
        out = model(ids, mlm_labels, nsp_labels)  # "keep": the last step's `out` lives till here
        if shape.trains == "nsp":
            F.cross_entropy(out[2], nsp_labels).backward()
        else:
            out[0].backward()
        optimizer.step()
        optimizer.zero_grad()
        if loop == "del":
            del out
        seconds.append(time.perf_counter() - start)
        timeline.mark(f"step {index}")
        served.append(lazygrad.stats(model).hits if lazy else 0)
        index += 1
    if then_batch is not None:
        ids, mlm_labels, nsp_labels = models.bert_batch(bert, batch=then_batch, seq=shape.seq)
        out = model(ids, mlm_labels, nsp_labels)
        (F.cross_entropy(out[2], nsp_labels) if shape.trains == "nsp" else out[0]).backward()
        if lazy:
            lazygrad.wait_for_builds(model)
    result = {"timeline": timeline.points, "step_s": seconds, "served": served}
    if lazy:
        stats = lazygrad.stats(model)
        result.update(builds=stats.builds, recomputes=stats.recomputes)
    return result


# ---------------------------------------------------------------- running probes


class MemoryCgroup:
    """A cgroup-v1 memory group for one probe, made under this process's own group: the child
    is moved into it before it execs, so the group's peak charge and limit cover the whole
    child and nothing else. `folder()` says whether one can be made here."""

    ROOT = Path("/sys/fs/cgroup/memory")

    def __init__(self, limit_bytes: int | None) -> None:
        parent = self.folder()
        if parent is None:
            raise RuntimeError("no writable cgroup-v1 memory group here")
        self.path = Path(tempfile.mkdtemp(prefix="lazygrad-memory-", dir=parent))
        if limit_bytes is not None:
            (self.path / "memory.limit_in_bytes").write_text(str(limit_bytes))

    @classmethod
    def folder(cls) -> Path | None:
        try:
            lines = Path("/proc/self/cgroup").read_text().splitlines()
        except OSError:
            return None
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if "memory" in controllers.split(","):
                own = cls.ROOT / path.lstrip("/")
                if (own / "memory.limit_in_bytes").exists() and os.access(own, os.W_OK):
                    return own
        return None

    def enter(self) -> None:
        """Run in the child between fork and exec (Popen's preexec_fn)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak_mib(self) -> float:
        return int((self.path / "memory.max_usage_in_bytes").read_text()) / MIB

    def oom_kills(self) -> int:
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def remove(self) -> None:
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


@dataclasses.dataclass
class Run:
    """One fresh process: what it was asked, whether it finished, and what it measured."""

    spec: dict
    ok: bool
    why: str  # "" when ok; else "out of memory (killed by the limit)", "timed out", an error
    seconds: float
    limit_mib: float | None = None
    cgroup_peak_mib: float | None = None  # the group's peak charge (anon, page cache, kernel)
    timeline: list[dict] = dataclasses.field(default_factory=list)
    step_s: list[float] = dataclasses.field(default_factory=list)
    builds: int | None = None
    recomputes: int | None = None
    served: list[int] = dataclasses.field(default_factory=list)  # steps served by ORT so far

    @property
    def first_served(self) -> int | None:
        """The first step whose backward ran through ORT (None: eager, or never)."""
        return next((i for i, count in enumerate(self.served) if count), None)

    @property
    def peak_mib(self) -> float:
        """Whole-process peak resident set (VmHWM / ru_maxrss over the whole run)."""
        return max(point["peak"] for point in self.timeline)

    def at(self, name: str) -> dict | None:
        return next((p for p in self.timeline if p["at"] == name), None)

    def step_added_mib(self, index: int) -> float:
        """Peak during step `index` above the resident set just before it."""
        names = [p["at"] for p in self.timeline]
        position = names.index(f"step {index}")
        return self.timeline[position]["peak"] - self.timeline[position - 1]["rss"]


def run_fresh(spec: dict, limit_mib: float | None = None, timeout: float = 600,
              cache: str | None = None) -> Run:
    """Run one probe in a new process (and memory group, where one can be made). `cache`: a
    lazygrad disk cache folder to use and keep (default: a new empty one, removed after)."""
    kept = cache is not None
    cache = cache or tempfile.mkdtemp(prefix="lazygrad-memory-cache-")
    env = {key: value for key, value in os.environ.items() if not key.startswith("MALLOC_")}
    env["LAZYGRAD_CACHE_DIR"] = cache
    group = MemoryCgroup(None if limit_mib is None else int(limit_mib * MIB)) if CGROUP else None
    start = time.perf_counter()
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.memory", "--probe", json.dumps(spec)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
            preexec_fn=group.enter if group else None,
        )
        try:
            stdout, stderr = child.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            child.kill()
            stdout, stderr = child.communicate()
            timed_out = True
        seconds = time.perf_counter() - start
        run = Run(spec, child.returncode == 0, "", seconds, limit_mib)
        if group:
            run.cgroup_peak_mib = group.peak_mib()
        if timed_out:
            run.ok, run.why = False, f"timed out after {timeout:.0f} s"
        elif group and group.oom_kills():
            run.ok, run.why = False, "out of memory (killed at the limit)"
        elif child.returncode != 0:
            run.why = f"exit {child.returncode}: {stderr.strip()[-2000:]}"
        if run.ok:
            found = json.loads(stdout.strip().splitlines()[-1])
            for key, value in found.items():
                setattr(run, key, value)
        return run
    finally:
        if not kept:
            shutil.rmtree(cache, ignore_errors=True)
        if group:
            group.remove()


CGROUP = MemoryCgroup.folder() is not None


# ---------------------------------------------------------------- the search (pure)


@dataclasses.dataclass(frozen=True)
class Search:
    """A bisection's outcome: `fits` is the largest batch seen (or assumed) to fit, `fails` the
    smallest seen (or assumed) not to; exact when they are adjacent and `fails` was probed."""

    fits: int
    fails: int
    probes: tuple[tuple[int, bool], ...]  # (batch, fitted), in the order run
    low: int  # the batch known to fit before the search (0: none)
    high: int  # the batch assumed not to fit

    @property
    def top(self) -> int:
        """The largest batch that may fit, as far as the probes tell."""
        return self.fails - 1

    @property
    def text(self) -> str:
        if self.fails == self.high and self.fits == self.high - 1:
            return f">= {self.fits}"
        if self.fails - self.fits == 1:
            return str(self.fits)
        return f"{self.fits}-{self.fails - 1}"


def bisect(fits: Callable[[int], bool], low: int, high: int, probes: int) -> Search:
    """Largest batch in [low, high) for which `fits`, given that `low` fits (0: trivially) and
    `high` does not, with at most `probes` calls; memory grows with the batch."""
    seen, start = [], (low, high)
    while high - low > 1 and len(seen) < probes:
        middle = (low + high) // 2
        fitted = fits(middle)
        seen.append((middle, fitted))
        low, high = (middle, high) if fitted else (low, middle)
    return Search(low, high, tuple(seen), *start)


# ---------------------------------------------------------------- tables and targets (pure)


def _pair(keep: float | None, drop: float | None, spec: str) -> str:
    show = lambda value: "—" if value is None else format(value, spec)  # noqa: E731
    return f"{show(keep)} / {show(drop)}"


def label(config: str) -> str:
    """A config's name in tables: "eager", a lazygrad policy, or policy+layers (the policy
    with `recompute_layers=True`)."""
    if config == "eager":
        return config
    policy, recompute_layers = lazy_options(config)
    return f'lazygrad "{policy}"' + (", recompute_layers" if recompute_layers else "")


def lazy_options(config: str) -> tuple[str, bool]:
    """A lazygrad config's policy and `recompute_layers` ("predict+layers": both)."""
    policy, _, layers = config.partition("+")
    return policy, layers == "layers"


def _grid(header: Sequence[str], rows: Sequence[Sequence[str]], text: Sequence[int] = (0,)) -> str:
    """A markdown table: the columns numbered in `text` left-aligned, the figures right-aligned."""
    rule = ["---" if i in text else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(rule) + " |"]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])


def peak_table(peaks: dict[tuple[str, str], float], added: dict[tuple[str, str], float],
               cgroup: dict[tuple[str, str], float] | None = None) -> str:
    """One workload's table; keys are (config, loop), values MiB."""
    header = [
        "config", "whole-process peak MiB (keep / del)", "x eager (keep / del)",
        'x "all" (keep / del)', "last step adds MiB (keep / del)",
    ]
    if cgroup:
        header.append("cgroup peak MiB (keep / del)")
    rows = []
    for config in CONFIGS:
        get = lambda table, loop, c=config: table.get((c, loop))  # noqa: E731
        ratio = lambda loop, base, c=config: (  # noqa: E731
            peaks[(c, loop)] / peaks[(base, loop)]
            if (c, loop) in peaks and (base, loop) in peaks else None
        )
        row = [
            label(config),
            _pair(get(peaks, "keep"), get(peaks, "del"), ".0f"),
            _pair(ratio("keep", "eager"), ratio("del", "eager"), ".2f"),
            _pair(ratio("keep", "all"), ratio("del", "all"), ".2f"),
            _pair(get(added, "keep"), get(added, "del"), ".0f"),
        ]
        if cgroup:
            row.append(_pair(get(cgroup, "keep"), get(cgroup, "del"), ".0f"))
        rows.append(row)
    return _grid(header, rows)


def batch_ratio(search: Search, eager: Search) -> tuple[float, float] | None:
    """The largest batch over eager's, as the lowest and highest ratio the probes allow."""
    if eager.fits == 0:
        return None
    return search.fits / eager.top, search.top / eager.fits


def _ratio_text(bounds: tuple[float, float] | None) -> str:
    if bounds is None:
        return "—"
    low, high = bounds
    return f"{low:.2f}" if low == high else f"{low:.2f}-{high:.2f}"


def batch_table(searches: dict[tuple[str, str], Search], budgets: dict[str, float]) -> str:
    """Largest batch per (workload, config), its ratio to eager's, and the probes run."""
    rows = []
    for (workload, config), search in searches.items():
        known = [f"{search.low} fits (the batch-{search.low} run)"] if search.low else []
        probes = known + [f"{b} {'fits' if ok else 'fails'}" for b, ok in search.probes]
        eager = searches[(workload, "eager")]
        ratio = "1.00" if search is eager else _ratio_text(batch_ratio(search, eager))
        rows.append([workload, label(config), f"{budgets[workload]:.0f}", search.text, ratio,
                     ", ".join(probes) or "—"])
    header = ["workload", "config", "budget MiB", "largest batch", "x eager", "probes"]
    return _grid(header, rows, text=(0, 1, 5))


@dataclasses.dataclass(frozen=True)
class Target:
    what: str
    measured: str
    verdict: str  # "met", "missed", "not measured", "undecided" (the probes left a range)


def _verdict(met: bool) -> str:
    return "met" if met else "missed"


def targets(peaks: dict[tuple[str, str, str], float],
            searches: dict[tuple[str, str], Search]) -> list[Target]:
    """Issue 10's done-when figures; `peaks` keys are (workload, config, loop)."""
    found = []
    for workload, bars in (("A", ("eager", "all")), ("B", ("eager",))):
        for loop in LOOPS:
            mine = peaks.get((workload, DEFAULT, loop))
            for base in bars:
                bound = 0.85 if base == "eager" else 1.0
                other = peaks.get((workload, base, loop))
                what = f"{workload}, {loop} loop: default policy <= {bound:.2f}x {label(base)}"
                if mine is None or other is None:
                    found.append(Target(what, "—", "not measured"))
                    continue
                ratio = mine / other
                found.append(Target(
                    what, f"{ratio:.2f}x ({mine:.0f} vs {other:.0f} MiB)",
                    _verdict(ratio <= bound),
                ))
    for workload, bound in (("A", 1.15), ("B", 1.0)):
        mine, eager = searches.get((workload, DEFAULT)), searches.get((workload, "eager"))
        what = f"{workload}: largest batch of the default policy >= {bound:.2f}x eager's"
        bounds = None if mine is None or eager is None else batch_ratio(mine, eager)
        if bounds is None:
            found.append(Target(what, "—", "not measured"))
            continue
        low, high = bounds
        verdict = "undecided" if low < bound <= high else _verdict(low >= bound)
        found.append(Target(
            what, f"{_ratio_text(bounds)}x (batch {mine.text} vs {eager.text})", verdict
        ))
    return found


def target_table(found: Sequence[Target]) -> str:
    rows = [[t.what, t.measured, f"**{t.verdict}**" if t.verdict == "missed" else t.verdict]
            for t in found]
    return _grid(["target", "measured", "verdict"], rows, text=(0, 1, 2))


def timeline_table(runs: Sequence[Run]) -> str:
    """Resident set (MiB) at each point of the keep-loop runs: where the memory goes. A lazy
    run's steps: the first (eager, its build starts at the backward), the eager steps while
    the graphs are built and checked (the largest peak), the first step served by ORT, and the
    last."""
    names = ["import torch", "import lazygrad", "model, optimizer, batch"]
    header = ["config", *names, "step 0: peak / after", "steps while building: steps, peak",
              "first ORT step: index, peak / after", "last step: peak / after",
              "anon after last step"]
    rows = []
    for run in runs:
        row = [label(run.spec["config"])]
        for name in names:
            point = run.at(name)
            row.append("—" if point is None else f"{point['rss']:.0f}")
        steps = [run.at(f"step {i}") for i in range(len(run.step_s))]
        row.append(f"{steps[0]['peak']:.0f} / {steps[0]['rss']:.0f}")
        first = run.first_served
        if first is None:
            row += ["—", "—"]
        else:
            between = steps[1:first]
            row.append(f"{len(between)}, {max(p['peak'] for p in between):.0f}" if between
                       else "0")
            row.append(f"{first}, {steps[first]['peak']:.0f} / {steps[first]['rss']:.0f}")
        row.append(f"{steps[-1]['peak']:.0f} / {steps[-1]['rss']:.0f}")
        row.append(f"{run.timeline[-1]['anon']:.0f}")
        rows.append(row)
    return _grid(header, rows)


def stage_table(runs: dict[tuple[str, str], Run]) -> str:
    """Every point of the diagnostic runs after the model is made, in order: the steps, and
    the build's stages marked from the builder thread (peak since the point before / resident
    set, MiB)."""
    rows = []
    for (workload, config), run in runs.items():
        start = next(i for i, p in enumerate(run.timeline) if p["at"] == "model, optimizer, batch")
        for point in run.timeline[start:]:
            rows.append([workload, label(config), point["at"],
                         f"{point['peak']:.0f} / {point['rss']:.0f}"])
    return _grid(["workload", "config", "point", "peak / after"], rows, text=(0, 1, 2))


def imports_table(imports: Run) -> str:
    rows, before = [], 0.0
    for point in imports.timeline:
        rows.append([point["at"], f"{point['rss']:.0f}", f"{point['rss'] - before:+.0f}",
                     f"{point['anon']:.0f}"])
        before = point["rss"]
    return _grid(["after", "RSS MiB", "added MiB", "anon MiB"], rows)


# ---------------------------------------------------------------- the run


def _say(start: float, message: str) -> None:
    print(f"[{time.perf_counter() - start:7.1f}s] {message}", flush=True)


def _train_spec(workload: str, config: str, loop: str, batch: int, steps: int,
                stages: bool = False, then_batch: int | None = None) -> dict:
    return {"kind": "train", "workload": workload, "config": config, "loop": loop,
            "batch": batch, "steps": steps, "stages": stages, "then_batch": then_batch}


def _checked(run: Run) -> Run:
    if not run.ok:
        raise RuntimeError(f"{run.spec} failed without a memory limit: {run.why}")
    return run


def measure(plan: Plan) -> dict:
    """Every fresh process of a run, in order: imports, the loops, then the searches."""
    start = time.perf_counter()
    imports = _checked(run_fresh({"kind": "imports"}))
    _say(start, f"imports: {imports.peak_mib:.0f} MiB after import lazygrad")
    runs: dict[tuple[str, str, str], Run] = {}
    for workload in plan.workloads:
        batch = WORKLOADS[workload].batch
        for config in CONFIGS:
            for loop in plan.loops:
                run = _checked(run_fresh(_train_spec(workload, config, loop, batch, plan.steps)))
                runs[(workload, config, loop)] = run
                _say(start, f"{workload} {config:<9} {loop:<4} batch {batch}: peak "
                     f"{run.peak_mib:6.0f} MiB, cgroup {run.cgroup_peak_mib or 0:6.0f} MiB, "
                     f"steps {', '.join(f'{s:.1f}' for s in run.step_s)} s")
    staged: dict[tuple[str, str], Run] = {}
    for workload in plan.workloads:
        for config in plan.staged:
            spec = _train_spec(workload, config, "keep", WORKLOADS[workload].batch, 2, True)
            run = staged[(workload, config)] = _checked(run_fresh(spec))
            _say(start, f"{workload} {config:<9} build stages: " + ", ".join(
                f"{p['at']} {p['peak']:.0f}" for p in run.timeline[4:]))
    budgets, searches, probes = {}, {}, []
    for workload in plan.workloads:
        batch = WORKLOADS[workload].batch
        base = runs[(workload, "eager", "keep")]
        budgets[workload] = base.cgroup_peak_mib if CGROUP else base.peak_mib
        for config in CONFIGS:
            def fits(size: int, workload=workload, config=config) -> bool:
                spec = _train_spec(workload, config, "keep", size, plan.steps)
                run = run_fresh(spec, budgets[workload] if CGROUP else None)
                ok = run.ok and (CGROUP or run.peak_mib <= budgets[workload])
                probes.append(run)
                peak = f"peak {run.peak_mib:.0f} MiB, " if run.timeline else ""
                _say(start, f"probe {workload} {config:<9} batch {size:3d}: "
                     f"{'fits' if ok else 'fails'} {run.why[:60]} ({peak}{run.seconds:.0f} s)")
                return ok

            # The batch-16 run fits if its unconstrained peak stayed within the budget: a limit
            # it never reached would not have changed it. Otherwise the search starts from 0.
            known = runs[(workload, config, "keep")]
            measured = known.cgroup_peak_mib if CGROUP else known.peak_mib
            low = max(plan.low, batch) if measured <= budgets[workload] else plan.low
            searches[(workload, config)] = bisect(fits, low, plan.high, plan.probes)
    return {"imports": imports, "runs": runs, "staged": staged, "budgets": budgets,
            "searches": searches, "probes": probes, "minutes": (time.perf_counter() - start) / 60}


def _machine() -> dict:
    memory = Path("/proc/meminfo").read_text().splitlines()[0].split()[1]
    versions = {name: metadata.version(name)
                for name in ("torch", "onnxruntime", "onnx", "onnxscript", "numpy")}
    return {
        "date": datetime.date.today().isoformat(), "cpus": os.cpu_count(),
        "memory_gib": round(int(memory) / 2**20, 1), "kernel": platform.release(),
        "python": platform.python_version(), "versions": versions,
        "load_average": round(os.getloadavg()[0], 2),
        "limit": "cgroup-v1 memory group per probe" if CGROUP else "none (peak compared)",
    }


def notes(plan: Plan, machine: dict, minutes: float) -> list[str]:
    versions = ", ".join(f"{k} {v}" for k, v in machine["versions"].items())
    limit = (
        "Each probe ran in its own cgroup-v1 memory group (made under this session's group) with "
        "memory.limit_in_bytes = the budget: a probe fits if it finishes its steps without being "
        "killed at the limit. The budget is the group's peak charge (memory.max_usage_in_bytes: "
        "anonymous memory, page cache the process itself brought in, kernel memory) of eager's "
        "batch-16 keep run; its whole-process peak RSS is the table's figure. Shared-library "
        "pages already cached are charged to whoever read them first, so the group's peak is "
        "below the RSS."
        if CGROUP else
        "No cgroup memory group could be made here, so no hard limit: a probe fits if its "
        "whole-process peak (VmHWM) is within the budget, eager's batch-16 keep-loop peak."
    )
    return [
        f"{'Quick' if plan is QUICK else 'Full'} run of {machine['date']}, {minutes:.0f} min; "
        f"{machine['cpus']} CPUs, {machine['memory_gib']} GiB, kernel {machine['kernel']}, "
        f"load average {machine['load_average']} at the end (other work shares the machine); "
        f"Python {machine['python']}, {versions}.",
        f"Every figure is one fresh process: `import torch` (and `import lazygrad` for lazygrad), "
        f"the model (seed 0), AdamW (lr 1e-4), steps of forward, backward, "
        "optimizer.step(), optimizer.zero_grad(); default allocator (no MALLOC_* variables); "
        "an empty private disk cache (LAZYGRAD_CACHE_DIR = a new temporary folder). Eager runs "
        f"{plan.steps} steps. Lazygrad (tiered execution, the default): step 0 runs eagerly and "
        "at its backward queues the build (trace, export, check) on the builder thread; the "
        "next steps run eagerly beside it until the graphs are ready, then through ORT; the "
        f"loop runs until ORT has served {plan.steps - 1} steps (at most {MAX_STEPS} steps), "
        "so the build, the eager steps beside it and steady steps are all in the peak.",
        "Whole-process peak: the high-water mark of the resident set (VmHWM, = ru_maxrss) over "
        "the whole process, first step included. It is read after each import and each step "
        "and reset after reading, so the timeline shows each stretch's own peak; the whole "
        "peak is the largest, the same figure an unreset high-water mark gives.",
        "keep: `out = model(...)` in a loop, so the previous step's outputs (and, in eager, the "
        "graph behind the outputs that got no backward) live while the next step runs. del: "
        "`del out` after optimizer.zero_grad().",
        "Last step adds: the peak during the last (steady) step above the resident set just "
        "before it: activations or stash, gradients, workspaces; not what limits a batch.",
        f"Largest batch: bisection over the batch in [{plan.low + 1}, {plan.high - 1}] (batch "
        f"{plan.high} assumed not to fit), at most {plan.probes} probes per peer, keep loop, "
        f"{plan.steps} steps, each probe a fresh process with its own empty disk cache (each "
        "pays a build). The batch-16 keep run counts as a fitting probe when its peak stayed "
        "within the budget (a limit it never reached would not have changed it). " + limit,
    ]


def report(plan: Plan, found: dict, machine: dict) -> tuple[str, dict]:
    runs: dict[tuple[str, str, str], Run] = found["runs"]
    peaks = {key: run.peak_mib for key, run in runs.items()}
    met = targets(peaks, found["searches"])
    lines = [
        "# Memory: whole-process peak as a user measures it (`python -m benchmarks.memory`)",
        "", "## Targets of issue 10", "", target_table(met), "",
    ]
    for workload in plan.workloads:
        shape = WORKLOADS[workload]
        pick = lambda f, w=workload: {  # noqa: E731
            (c, loop): f(run) for (wl, c, loop), run in runs.items() if wl == w
        }
        lines += [
            f"## Workload {workload}: {shape.title} (vocabulary {shape.vocab:,}, hidden "
            f"{shape.hidden}, {shape.layers} layers, batch {shape.batch}, seq {shape.seq})", "",
            peak_table(pick(lambda r: r.peak_mib),
                       pick(lambda r: r.step_added_mib(len(r.step_s) - 1)),
                       pick(lambda r: r.cgroup_peak_mib) if CGROUP else None),
            "",
        ]
    lines += [
        "## Largest batch within a fixed budget (eager's peak at batch 16, keep loop)", "",
        batch_table(found["searches"], found["budgets"]), "",
        "## Where the memory goes", "",
        "Resident set of a fresh process that only imports, one module after another:", "",
        imports_table(found["imports"]), "",
    ]
    for workload in plan.workloads:
        keep = [runs[(workload, c, "keep")] for c in CONFIGS]
        lines += [
            f"Workload {workload}, keep loop: resident set (MiB) after each stage, and each "
            "step's own peak:", "", timeline_table(keep), "",
        ]
    if found["staged"]:
        lines += [
            "The build in stages (diagnostic runs: keep loop, batch 16, until ORT serves a step; "
            "marks after lazygrad's capture, export and verify, made on the builder thread, "
            "between the training thread's step marks); each cell is the peak since the point "
            "before / the resident set after it, MiB:", "", stage_table(found["staged"]), "",
        ]
    lines += ["## How it was measured", "",
              *(f"- {note}" for note in notes(plan, machine, found["minutes"])), ""]
    data = {
        "machine": machine,
        "plan": dataclasses.asdict(plan),
        "imports": dataclasses.asdict(found["imports"]),
        "runs": [dataclasses.asdict(run) | {"peak_mib": run.peak_mib} for run in runs.values()],
        "staged": [dataclasses.asdict(run) for run in found["staged"].values()],
        "budgets_mib": found["budgets"],
        "searches": [
            {"workload": w, "config": c, **dataclasses.asdict(s), "text": s.text}
            for (w, c), s in found["searches"].items()
        ],
        "probes": [dataclasses.asdict(run) for run in found["probes"]],
        "targets": [dataclasses.asdict(t) for t in met],
    }
    return "\n".join(lines), data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.memory",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="workload A, keep loop, 3 steps, 2 probes per peer (6-10 min)")
    parser.add_argument("--probe", help=argparse.SUPPRESS)  # JSON: one fresh process's job
    args = parser.parse_args(argv)
    if args.probe:
        import warnings

        warnings.simplefilter("ignore")
        spec = json.loads(args.probe)
        kind = spec.pop("kind")
        print(json.dumps(probe_imports() if kind == "imports" else probe_train(**spec)))
        return 0
    plan = QUICK if args.quick else FULL
    found = measure(plan)
    text, data = report(plan, found, _machine())
    RESULTS.mkdir(exist_ok=True)
    stem = "memory-quick" if args.quick else "memory"
    (RESULTS / f"{stem}.md").write_text(text)
    (RESULTS / f"{stem}.json").write_text(json.dumps(data, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
