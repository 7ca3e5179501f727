"""Built graphs survive the process: reused by a second model or process, never torn."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import torch
from conftest import MODEL_CASES, assert_close, compose_loss, lazy_copy, reference_vjp

import lazygrad
from lazygrad import disk_cache

MASK = (True, False, True)
OTHER_MASK = (False, True, False)


def _step_and_check(model, lazy, inputs, mask=MASK):
    outputs = lazy(*inputs)
    cotangents = [torch.randn_like(o) for o in outputs]
    lazy.zero_grad(set_to_none=True)
    compose_loss(outputs, mask, cotangents).backward()
    _, expected, _ = reference_vjp(model, inputs, mask, cotangents)
    for name, p in lazy.named_parameters():
        if p.grad is not None:
            assert_close(p.grad, expected[name], name)


def test_a_second_model_loads_the_graphs_instead_of_building(private_disk_cache):
    model, inputs = MODEL_CASES["bert"]()
    _step_and_check(model, lazy_copy(model), inputs)
    assert len(list(private_disk_cache.glob("*.lazygrad"))) == 1  # the pair of this mask
    second = lazy_copy(model)
    for _ in range(2):  # both through the graphs the disk index names: no eager first step
        _step_and_check(model, second, inputs)
    stats = lazygrad.stats(second)
    assert (stats.builds, stats.disk_hits, stats.misses, stats.hits) == (0, 1, 0, 2)
    assert stats.eager_steps == 0
    assert all(entry.from_disk for entry in stats.entries)


def test_a_second_process_skips_gradient_building(private_disk_cache):
    script = textwrap.dedent(
        """
        import torch, lazygrad
        from conftest import MODEL_CASES, lazy_copy
        model, inputs = MODEL_CASES["bert"]()
        lazy = lazy_copy(model)
        outputs = lazy(*inputs)
        (outputs[0] + outputs[2].sum()).backward()
        print(lazygrad.stats(lazy).builds)
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        cwd=Path(__file__).parent,  # so the child imports conftest's models; it inherits the
        capture_output=True,  # LAZYGRAD_CACHE_DIR the fixture set
        text=True,
        check=True,
    )
    assert run.stdout.strip().splitlines()[-1] == "1"
    model, inputs = MODEL_CASES["bert"]()
    lazy = lazy_copy(model)
    for _ in range(2):
        _step_and_check(model, lazy, inputs)
    assert (lazygrad.stats(lazy).builds, lazygrad.stats(lazy).disk_hits) == (0, 1)


def test_a_corrupted_or_truncated_file_is_discarded_and_rebuilt(private_disk_cache):
    model, inputs = MODEL_CASES["three_head_mlp"]()
    first = lazy_copy(model)
    for mask in (MASK, OTHER_MASK):
        _step_and_check(model, first, inputs, mask)
    files = sorted(private_disk_cache.glob("*.lazygrad"))
    assert len(files) == 2
    data = files[0].read_bytes()
    files[0].write_bytes(data[: len(data) // 2])  # truncated
    damaged = bytearray(files[1].read_bytes())
    damaged[-10] ^= 0xFF  # one flipped byte inside the model
    files[1].write_bytes(bytes(damaged))
    lazy = lazy_copy(model)
    for mask in (MASK, OTHER_MASK):
        _step_and_check(model, lazy, inputs, mask)
    stats = lazygrad.stats(lazy)
    assert (stats.builds, stats.disk_hits) == (2, 0)
    again = lazy_copy(model)  # the rebuilt files are whole again
    for mask in (MASK, OTHER_MASK):
        _step_and_check(model, again, inputs, mask)
    assert lazygrad.stats(again).disk_hits == 2


def test_concurrent_writers_and_readers_never_see_a_torn_file(tmp_path):
    model, inputs = MODEL_CASES["three_head_mlp"]()
    lazy = lazy_copy(model)
    for mask in (MASK, OTHER_MASK):
        _step_and_check(model, lazy, inputs, mask)
    runtime = lazygrad.api.runtime_of(lazy)
    graphs = [entry.pair.graphs for entry in runtime._pairs.values()]
    assert graphs[0].backward_feeds != graphs[1].backward_feeds
    cache = disk_cache.DiskCache(tmp_path / "shared")
    problems: list[str] = []

    def write(graph):
        for _ in range(30):
            cache.store("same-key", graph)

    def read():
        for _ in range(200):
            graph = cache.load("same-key")
            if graph is not None and graph.backward_feeds not in [
                g.backward_feeds for g in graphs
            ]:
                problems.append("mixed file")

    threads = [threading.Thread(target=write, args=(g,)) for g in graphs]
    threads += [threading.Thread(target=read) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not problems
    assert cache.load("same-key") is not None
    assert not list((tmp_path / "shared").glob("*.tmp"))  # no temporary files left behind


def test_empty_cache_dir_variable_turns_the_disk_cache_off(monkeypatch, tmp_path):
    monkeypatch.setenv("LAZYGRAD_CACHE_DIR", "")
    assert disk_cache.default_directory() is None
    model, inputs = MODEL_CASES["three_head_mlp"]()
    _step_and_check(model, lazy_copy(model), inputs)
    second = lazy_copy(model)
    _step_and_check(model, second, inputs)
    assert lazygrad.stats(second).disk_hits == 0
