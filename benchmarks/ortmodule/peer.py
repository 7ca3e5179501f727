"""ORTModule and eager PyTorch on the benchmark's workloads, inside ORTModule's environment.

`python -m benchmarks.ortmodule.peer WORKLOAD... --rounds N` with the Python of the environment
that `make_env.sh` made (torch 2.4.1, onnxruntime-training 1.19.2); prints one JSON object. The
workloads are `benchmarks/workloads.py`'s, the same models and losses as the main run.

lazygrad itself cannot be imported there (it needs torch 2.13), so the example models' file, which
needs only torch, is loaded by its path under its usual module name before the workloads are.
ORTModule is compared with eager PyTorch of its own environment, interleaved as in the main run,
so its ratio to eager stands beside lazygrad's ratio to its own eager. Its sessions keep ORT's
default of threads that spin on after a run: for about 50 ms they slowed the eager steps that
followed (a MoE step 7.9 ms right after, 3.2 from the eighth on), which a loop of eager alone never
pays. So each peer's timed step follows `LEAD_SECONDS` of its own steps.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import types
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Untimed steps of its own before each peer's timed step (`timing.interleave`): about three
# times as long as ORTModule's spinning threads slowed the next steps.
LEAD_SECONDS = 0.15


def _load_example_models() -> None:
    for name in ("lazygrad", "lazygrad.examples"):
        package = types.ModuleType(name)
        package.__path__ = []
        sys.modules[name] = package
    path = REPO / "lazygrad" / "examples" / "models.py"
    spec = importlib.util.spec_from_file_location("lazygrad.examples.models", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workloads", nargs="+")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    _load_example_models()
    import onnxruntime
    import torch
    from onnxruntime.training.ortmodule import DebugOptions, LogLevel, ORTModule

    from benchmarks.timing import interleave, paired_ratio
    from benchmarks.workloads import WORKLOADS

    figures = {}
    # One model per peer runs the workloads in turn, as in the main run (same seeded weights).
    first = WORKLOADS[args.workloads[0]]
    eager = first.model()
    ortmodule = ORTModule(first.model(), DebugOptions(log_level=LogLevel.ERROR))
    for name in args.workloads:
        workload = WORKLOADS[name]
        steps = {"eager": workload.step(eager), "ortmodule": workload.step(ortmodule)}
        started = time.perf_counter()
        steps["ortmodule"](0)
        first_step = time.perf_counter() - started
        started = time.perf_counter()
        steps["eager"](0)
        eager_first_step = time.perf_counter() - started
        interleave(steps, workload.settle, first_round=1)
        samples = interleave(steps, args.rounds, first_round=1 + workload.settle,
                             lead_seconds=LEAD_SECONDS)
        figures[name] = {
            "first_step_s": first_step,
            "eager_first_step_s": eager_first_step,
            "median_s": samples["ortmodule"].median,
            "eager_median_s": samples["eager"].median,
            "ratio": paired_ratio(samples["ortmodule"].times, samples["eager"].times),
        }
    print(json.dumps({
        "versions": {"torch": torch.__version__, "onnxruntime-training": onnxruntime.__version__,
                     "python": sys.version.split()[0]},
        "workloads": figures,
    }))


if __name__ == "__main__":
    main()
