"""Start the ORTModule peer in its own environment and read its figures (issue 11, item 4).

ORTModule's last release (onnxruntime-training 1.19.2) needs torch 2.4, which cannot share a
process with lazygrad's torch: it runs in the environment `make_env.sh` makes, in a subprocess,
on the same workloads. Without that environment the report says ORTModule was not measured.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

from benchmarks.ortmodule.peer import REPO

ENV_VAR = "LAZYGRAD_ORTMODULE_ENV"


@dataclasses.dataclass(frozen=True)
class Figures:
    """ORTModule on one workload, against eager PyTorch in its own environment."""

    first_step_s: float  # its first call and backward: export, gradient graph, sessions
    eager_first_step_s: float
    median_s: float
    eager_median_s: float
    ratio: float  # median over rounds of its step / its eager's step in the same round


def python() -> Path | None:
    """The environment's interpreter, or None when `make_env.sh` has not made it."""
    directory = Path(os.environ.get(ENV_VAR) or REPO / ".ortmodule-env")
    interpreter = directory / "bin" / "python"
    return interpreter if interpreter.exists() else None


def measure(workloads: list[str], rounds: int) -> tuple[dict[str, Figures], dict[str, str]]:
    """Figures per workload (one process, one model, the workloads in turn) and the versions."""
    interpreter = python()
    if interpreter is None:
        return {}, {}
    done = subprocess.run(
        [str(interpreter), "-m", "benchmarks.ortmodule.peer", *workloads, "--rounds", str(rounds)],
        cwd=REPO, capture_output=True, text=True, check=True,
    )
    found = json.loads(done.stdout.strip().splitlines()[-1])
    figures = {name: Figures(**values) for name, values in found["workloads"].items()}
    return figures, found["versions"]
