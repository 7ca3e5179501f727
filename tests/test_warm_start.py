"""A second process of the same training, with the disk cache warm, runs through ORT from its
first step (the disk index), and an index that no longer matches the code is never trusted."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
MASKS = [(True, False, True), (True, False, True), (False, True, False), (True, False, True)]

# One training in a child process: the lazy model and its eager twin (same weights, same inputs)
# step through MASKS; per step, whether ORT ran it and the largest relative error of outputs
# and gradients against eager's; then the statistics and the warnings seen.
TRAINING = textwrap.dedent(
    """
    import copy, json, sys, warnings
    import torch, lazygrad
    from conftest import lazy_copy, ran_through_ort, relative_error
    warnings.simplefilter("always")
    {model}
    masks = {masks}
    lazy, eager = lazy_copy(model), copy.deepcopy(model)
    steps = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for index, mask in enumerate(masks):
            torch.manual_seed(index)
            got, expected = lazy(*inputs), eager(*inputs)
            cotangents = [torch.randn_like(o) for o in expected]
            for module, outputs in ((lazy, got), (eager, expected)):
                module.zero_grad(set_to_none=True)
                sum((o * c).sum() for o, c, bit in zip(outputs, cotangents, mask) if bit).backward()
            errors = [relative_error(g, e) for g, e in zip(got, expected)]
            for (name, p), q in zip(lazy.named_parameters(), eager.parameters()):
                assert (p.grad is None) == (q.grad is None), name
                if q.grad is not None:
                    errors.append(relative_error(p.grad, q.grad))
            steps.append({{"ort": ran_through_ort(got), "error": max(errors)}})
        lazygrad.wait_for_builds(lazy)
    stats = lazygrad.stats(lazy)
    print(json.dumps({{
        "steps": steps,
        "stats": {{k: getattr(stats, k) for k in
                  ("builds", "exports", "disk_hits", "eager_steps", "fallbacks", "breaks")}},
        "sources": ["disk" if e.from_disk else "built" for e in stats.entries],
        "warnings": [str(w.message) for w in caught
                     if issubclass(w.category, lazygrad.FallbackWarning)],
        # what only a build needs (the tracer, the exporter, symbolic sizes)
        "build_modules": [m for m in ("torch._dynamo", "onnxscript", "sympy") if m in sys.modules],
    }}))
    """
)
# A multi-output model whose builds take seconds: each training is a fresh process.
THREE_HEADS = """
from conftest import MODEL_CASES
model, inputs = MODEL_CASES["three_head_mlp"]()
"""


def train(cache: Path, model: str, path: Path | None = None) -> dict:
    """Run TRAINING in a new process on the disk cache `cache`; its report."""
    env = dict(
        os.environ,
        LAZYGRAD_CACHE_DIR=str(cache),
        LAZYGRAD_WAIT_FOR_BUILDS="0",
        # this checkout's lazygrad, the tests' helpers, and `path` (a model module of a test)
        PYTHONPATH=os.pathsep.join(str(p) for p in (ROOT, ROOT / "tests", path) if p),
    )
    script = TRAINING.format(model=model, masks=MASKS)
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT / "tests", env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def assert_like_eager(report: dict) -> None:
    for index, step in enumerate(report["steps"]):
        assert step["error"] <= 1e-5, f"step {index}: relative error {step['error']:.2e}"


def test_a_second_process_runs_through_ort_from_its_first_step(tmp_path):
    cache = tmp_path / "cache"
    first = train(cache, THREE_HEADS)
    assert_like_eager(first)
    assert not first["steps"][0]["ort"]  # no graphs yet: eager while they build
    assert first["stats"]["builds"] == 2  # the two masks
    second = train(cache, THREE_HEADS)
    assert_like_eager(second)
    assert all(step["ort"] for step in second["steps"]), second["steps"]
    assert second["stats"] == {"builds": 0, "exports": 0, "disk_hits": 2, "eager_steps": 0,
                               "fallbacks": 0, "breaks": 0}
    assert second["sources"] == ["disk", "disk"]
    assert second["warnings"] == []
    assert second["build_modules"] == []  # a served process never imports them


MODULE = """
import torch
from torch import nn

from factor import FACTOR

SCALE = {scale}


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3), nn.Linear(8, 2)

    def forward(self, x):
        from shift import SHIFT  # a helper imported inside the forward only

        h = torch.tanh(self.body(x)) * SCALE * FACTOR + SHIFT
        return self.a(h), self.b(h), h.sum()
"""
TWO_HEADS = """
from two_heads import TwoHeads
torch.manual_seed(0)
model, inputs = TwoHeads(), (torch.randn(4, 8),)
"""


def write_model(folder: Path, scale: float = 2.0, factor: float = 1.0,
                shift: float = 0.0) -> Path:
    """The model's class in `two_heads.py`, which reads FACTOR from `factor.py` when imported
    and SHIFT from `shift.py` in its forward."""
    folder.mkdir(exist_ok=True)
    (folder / "two_heads.py").write_text(MODULE.format(scale=scale))
    (folder / "factor.py").write_text(f"FACTOR = {factor}\n")
    (folder / "shift.py").write_text(f"SHIFT = {shift}\n")
    return folder


@pytest.mark.parametrize(
    "change",
    [{"scale": 3.0}, {"factor": 1.5}, {"shift": 0.5}],
    ids=["the class's file", "a helper it imports", "a helper its forward imports"],
)
def test_a_changed_source_file_misses_the_index(tmp_path, change):
    """Whether in the class's own file or in a file it imports, directly or only inside a
    function, changed code is in the index key: the second process builds again (eager steps
    meanwhile), and its results are eager's from the first step."""
    cache = tmp_path / "cache"
    code = write_model(tmp_path / "code")
    first = train(cache, TWO_HEADS, path=code)
    assert first["stats"]["builds"] == 2
    write_model(code, **change)
    changed = train(cache, TWO_HEADS, path=code)
    assert_like_eager(changed)
    assert not changed["steps"][0]["ort"]  # the index missed: eager while building
    assert (changed["stats"]["builds"], changed["stats"]["disk_hits"]) == (2, 0)
    assert changed["stats"]["fallbacks"] == 0 and changed["warnings"] == []
    again = train(cache, TWO_HEADS, path=code)  # the records the rebuilds wrote are right
    assert_like_eager(again)
    assert again["warnings"] == [] and again["stats"]["builds"] == 0
    assert again["stats"]["fallbacks"] == 0
    assert all(step["ort"] for step in again["steps"])


def _key(model, *inputs):
    from lazygrad.index_key import index_key
    from lazygrad.module_state import ModuleState
    from lazygrad.signature import flatten_call, signature_of

    state, modes = ModuleState(model).read()
    return index_key(model, signature_of(flatten_call(inputs, {}), state, modes), list(state))


def test_the_index_key_is_the_same_for_equal_models_and_none_where_it_cannot_be_sure():
    import dataclasses

    from lazygrad.examples.models import BertConfig, BertPretraining, bert_batch

    config = BertConfig(vocab=50, hidden=8, layers=1, heads=2)
    batch = bert_batch(config, batch=2, seq=4)
    model = BertPretraining(config)
    key = _key(model, *batch)
    assert key is not None and key == _key(BertPretraining(config), *batch)  # weights aside
    model.pooler.config = config  # an object: hashed through its __dict__
    with_config = _key(model, *batch)
    assert with_config not in (None, key)
    model.pooler.config = dataclasses.replace(config, dropout=0.1)
    assert _key(model, *batch) not in (None, with_config)
    scale = 2.0
    model.pooler.scale = lambda x: x * scale  # a closure: its behaviour cannot be hashed
    assert _key(model, *batch) is None
    assert _key(BertPretraining(config), *bert_batch(config, batch=2, seq=5)) == _key(
        BertPretraining(config), *bert_batch(config, batch=3, seq=6))  # sizes are symbols
    assert _key(BertPretraining(config).eval(), *batch) != key
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *args: None)
    try:  # a global hook: whether the model runs whole is the capture's to decide
        assert _key(BertPretraining(config), *batch) is None
    finally:
        handle.remove()


def _keep_requires_grad(module, args, output):
    output.requires_grad_(True)


def _checkpointing_model(reentrant: bool, hooks_before: int) -> torch.nn.Module:
    """As transformers' `gradient_checkpointing_enable()` leaves a model: a checkpointing
    function (a partial of torch's, itself a wrapper) on its layer, and a forward hook whose
    handle the model keeps; `hooks_before` others registered first move the hook's id."""
    for _ in range(hooks_before):
        torch.nn.Identity().register_forward_hook(_keep_requires_grad)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4))
    model[1].checkpointing = functools.partial(torch.utils.checkpoint.checkpoint,
                                               use_reentrant=reentrant)
    model.handle = model[0].register_forward_hook(_keep_requires_grad)
    return model


def test_the_index_key_hashes_a_checkpointing_function_and_hooks_by_what_they_are():
    """A model with gradient checkpointing got no index key (a partial, a library's wrapper
    function, a hook's handle), so a second process ran its first steps eagerly; and a hook
    dict hashed by handle ids, which count every hook the process registered before."""
    ids = torch.tensor([[1, 2, 3]])
    key = _key(_checkpointing_model(False, 0), ids)
    assert key is not None
    assert _key(_checkpointing_model(False, 3), ids) == key
    assert _key(_checkpointing_model(True, 0), ids) not in (None, key)


def test_the_index_key_reads_the_helper_files_down_to_installed_packages(tmp_path, monkeypatch):
    """Modules the model's file imports, at its top or inside a function, absolutely or
    relatively, and the modules those import: hashed; installed packages (torch) and lazygrad:
    named by their versions, not read; a name imported from a module is not a module."""
    from lazygrad.index_key import _helper_files

    package = tmp_path / "project"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "model.py").write_text(
        "import torch\nfrom . import blocks\nfrom .consts import WIDTH\n"
        "def forward():\n    import project.late\n")
    (package / "blocks.py").write_text("import lazygrad\nimport project.deep\n")
    for name in ("consts", "late", "deep"):
        (package / f"{name}.py").write_text("WIDTH = 3\n")
    (package / "unused.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "project", raising=False)
    found = dict(_helper_files(["project.model"]))
    assert sorted(found) == ["project", "project.blocks", "project.consts", "project.deep",
                             "project.late", "project.model"]
    assert "project.late" not in sys.modules  # located without importing it


def test_sizes_that_varied_are_symbols_from_a_next_processs_first_call(private_disk_cache):
    """A first training whose batch size varied made it a symbol; the next one (a new
    runtime on the same disk cache) starts with it so: its first call, at a batch size the
    first never ran, is served by the first's graphs through ORT, with no build."""
    import torch
    from conftest import lazy_copy, ran_through_ort, sum_step_like_eager

    import lazygrad

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    first = lazy_copy(model)
    for batch in (4, 4, 5, 6):
        sum_step_like_eager(first, model, (torch.randn(batch, 6),), f"first, batch {batch}")
    assert lazygrad.stats(first).exports == 2  # exact, then the batch a symbol
    second = lazy_copy(model)
    got = sum_step_like_eager(second, model, (torch.randn(9, 6),), "second, batch 9")
    assert ran_through_ort(got)
    stats = lazygrad.stats(second)
    assert (stats.builds, stats.eager_steps, stats.disk_hits, stats.fallbacks) == (0, 0, 1, 0)
