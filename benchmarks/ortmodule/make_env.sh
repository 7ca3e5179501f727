#!/usr/bin/env bash
# Creates the second environment in which ORTModule (onnxruntime-training) runs as a peer of
# `python -m benchmarks`: ORTModule's last release needs torch 2.4.x, which cannot share a
# process (or an environment) with lazygrad's torch. The benchmark finds it at
# $LAZYGRAD_ORTMODULE_ENV (default: .ortmodule-env in the repository) and runs the peer in a
# subprocess; without it the report says ORTModule was not measured.
#
# PyPI's torch 2.4.1 is a CUDA build (about 5 GB with its CUDA libraries); it runs on the CPU.
# ORTModule's C++ extensions are built for the CPU by forcing torch.version.cuda to None, as
# their installer otherwise compiles CUDA kernels.
set -euo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
env_dir="${LAZYGRAD_ORTMODULE_ENV:-$repo/.ortmodule-env}"
python3.11 -m venv "$env_dir"
"$env_dir/bin/pip" install -q --upgrade pip
# The machine's pip constraints cap torch for the main environment only.
PIP_CONFIG_FILE=/dev/null "$env_dir/bin/pip" install -q \
    "torch==2.4.1" "onnxruntime-training==1.19.2" "onnx==1.16.2" "numpy<2" "packaging" "sympy"
"$env_dir/bin/python" - <<'PY'
import runpy
import torch
torch.version.cuda = None
runpy.run_module("onnxruntime.training.ortmodule.torch_cpp_extensions.install", run_name="__main__")
PY
"$env_dir/bin/python" -c "from onnxruntime.training.ortmodule import ORTModule; print('ORTModule ready')"
