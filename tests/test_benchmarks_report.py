"""The benchmark report renders fake figures into a table (no timing, no plotting: fast)."""

from __future__ import annotations

from benchmarks import report


def test_report_table_shows_ratios_and_dashes_for_figures_not_measured() -> None:
    rows = [
        report.Row("bert loss", "eager", 0.3, 1.0, first_step_s=0.5, peak_mib=190.0),
        report.Row(
            "bert loss", "lazygrad", 0.25, 0.83, steps_per_s=4.0, first_step_s=1.5,
            peak_mib=450.0, exports=1, builds=2, hit_rate=0.8, warm_first_step_s=0.4,
            warm_through_ort=True,
        ),
    ]
    text = report.markdown(rows, ["how it was measured"])
    lines = text.splitlines()
    assert lines[2].startswith("| workload")
    assert "| 0.83 " in lines[5] and "| 80.0% " in lines[5] and "| 250.0 " in lines[5]
    assert "| 0.40 (ORT) " in lines[5]  # lazygrad's first step in a second process
    # eager: no steps/s, graphs ready, warm-cache first step, exports, builds, hit rate
    assert lines[4].count("—") == 6
    assert "- how it was measured" in lines


def test_build_table_shows_stages_per_mask_beside_the_previous_design() -> None:
    rows = [report.Row("bert loss", "lazygrad", 1.2, 1.25)]
    builds = [
        report.BuildRow(
            "bert loss", "lazygrad", (True, False, False),
            {"trace": 11.0, "export": 3.5, "check": 6.0}, 21.2, 1.25,
        ),
        report.BuildRow("bert loss + scores", "lazygrad all", None, {}, None, 1.1),
    ]
    lines = report.markdown(rows, ["how it was measured"], builds).splitlines()
    built = next(line for line in lines if line.startswith("| bert loss ") and "| 100 " in line)
    assert "| 11.0 " in built and "| 21.2 " in built and "| 1.25 " in built
    assert "| 1.14 " in built and "| 0.02-0.06 " in built  # previous design, quoted
    reused = next(line for line in lines if "none new" in line)
    assert "| 1.07 " in reused  # previous design's x eager for 'lazygrad all', loss + scores
    assert any("not re-measured" in line for line in lines)


def test_ortmodule_notes_give_the_target_ratio_and_both_environments_eager_steps() -> None:
    from benchmarks.__main__ import ortmodule_notes

    rows = [
        report.Row("bert loss", "eager", 0.25, 1.0),
        report.Row("bert loss", "lazygrad", 0.2, 0.8),
        report.Row("bert loss", "ORTModule", 0.33, 1.0),
    ]
    notes = ortmodule_notes(rows, {"onnxruntime-training": "1.19.2", "torch": "2.4.1",
                                   "python": "3.11.7"}, {"bert loss": 0.32})
    assert "bert loss 0.80" in notes[-2]  # 0.8x against ORTModule's 1.0x
    assert "bert loss 320.0 against 250.0 ms" in notes[-1]
    assert "not measured" in ortmodule_notes([], {}, {})[0]


def test_memory_bisection_finds_the_largest_fitting_batch_within_its_probes() -> None:
    from benchmarks import memory

    seen = []

    def fits(batch: int) -> bool:
        seen.append(batch)
        return batch <= 19

    search = memory.bisect(fits, 0, 64, probes=6)
    assert (search.fits, search.fails, search.text) == (19, 20, "19")
    assert [b for b, _ in search.probes] == seen == [32, 16, 24, 20, 18, 19]
    coarse = memory.bisect(lambda batch: batch <= 19, 0, 64, probes=2)
    assert (coarse.text, coarse.top) == ("16-31", 31)  # a bracket when the probes run out
    assert memory.bisect(lambda batch: True, 0, 8, probes=6).text == ">= 7"  # never failed
    assert memory.bisect(lambda batch: False, 0, 8, probes=6).text == "0"
    started = memory.bisect(lambda batch: batch <= 17, 16, 64, probes=6)  # 16 known to fit
    assert started.text == "17" and started.low == 16


def test_memory_targets_compare_the_default_policy_with_eager_and_all() -> None:
    from benchmarks import memory

    peaks = {
        ("A", "eager", "keep"): 1000.0, ("A", "all", "keep"): 1500.0,
        ("A", "predict", "keep"): 800.0,
        ("A", "eager", "del"): 1000.0, ("A", "all", "del"): 700.0,
        ("A", "predict", "del"): 800.0,
    }
    searches = {
        ("A", "eager"): memory.Search(16, 17, (), 0, 64),
        ("A", "predict"): memory.Search(16, 32, (), 0, 64),  # 16-31: 1.00-1.94x eager's
        ("B", "eager"): memory.Search(16, 17, (), 0, 64),
        ("B", "predict"): memory.Search(12, 13, (), 0, 64),
    }
    found = {t.what: t for t in memory.targets(peaks, searches)}
    assert found["A, keep loop: default policy <= 0.85x eager"].verdict == "met"
    assert found['A, keep loop: default policy <= 1.00x lazygrad "all"'].verdict == "met"
    missed = found['A, del loop: default policy <= 1.00x lazygrad "all"']
    assert missed.verdict == "missed" and missed.measured.startswith("1.14x")
    assert found["B, keep loop: default policy <= 0.85x eager"].verdict == "not measured"
    assert found["A: largest batch of the default policy >= 1.15x eager's"].verdict == "undecided"
    batch_b = found["B: largest batch of the default policy >= 1.00x eager's"]
    assert batch_b.verdict == "missed" and batch_b.measured.startswith("0.75x")
    assert "| **missed** |" in memory.target_table(list(found.values()))


def test_memory_targets_add_each_run_above_the_runs_before() -> None:
    from benchmarks.memory_targets import TITLE, newest_first

    first = newest_first("", ["## run 1", "", "| A | 1 |"])
    second = newest_first(first, ["## run 2"])
    assert second.splitlines()[0] == TITLE
    assert second.index("## run 2") < second.index("## run 1") < second.index("| A | 1 |")
    assert second.count(TITLE) == 1 and second.endswith("| A | 1 |\n")


def test_memory_peak_table_shows_both_loops_and_ratios() -> None:
    from benchmarks import memory

    peaks = {("eager", "keep"): 1000.0, ("eager", "del"): 900.0,
             ("all", "keep"): 2000.0, ("all", "del"): 1800.0,
             ("predict", "keep"): 1500.0}
    added = {key: 100.0 for key in peaks}
    lines = memory.peak_table(peaks, added).splitlines()
    predict = next(line for line in lines if '"predict"' in line)
    assert "| 1500 / — | 1.50 / — | 0.75 / — | 100 / — |" in predict
    assert lines[1] == "| --- | ---: | ---: | ---: | ---: |"


def test_faults_table_pairs_each_peer_with_eager_of_its_round() -> None:
    from benchmarks import faults

    def row(seconds: float, faults_per_step: float, in_ort: float | None) -> dict:
        return {"step_s": seconds, "faults": faults_per_step, "ort_faults": in_ort,
                "fallbacks": None if in_ort is None else 0}

    rows = {}
    for allocator in faults.ALLOCATORS:
        rows[allocator, "eager"] = [row(0.2, 30000, None), row(0.4, 30000, None)]
        rows[allocator, "lazygrad, cold cache"] = [row(0.1, 10, 2), row(0.4, 30, 4)]
        rows[allocator, "lazygrad, warm cache"] = [row(0.3, 20000, 8000), row(0.4, 20000, 8000)]
    lines = faults.table("bert all three", rows)
    assert lines[0] == "### bert all three"
    assert "| default | eager | 300.0 | 1.000 | 30000 | — |" in lines
    # per round 0.5 and 1.0: their median, not the ratio of medians (250 / 300)
    assert "| default | lazygrad, cold cache | 250.0 | 0.750 | 20 | 3 |" in lines
    assert "| default | lazygrad, warm cache | 350.0 | 1.250 | 20000 | 8000 |" in lines


def test_memory_targets_report_the_median_of_repeated_processes_with_their_range() -> None:
    from benchmarks.memory_targets import eager_cell, peak_cell

    assert peak_cell([900.0, 1000.0, 850.0], [1000.0, 1100.0, 1050.0]) == "900 (0.86x; 850-1000)"
    assert peak_cell([900.0], [1000.0]) == "900 (0.90x)"
    assert eager_cell([1000.0, 1100.0, 1050.0]) == "1050 (1000-1100)"
    assert eager_cell([1000.0]) == "1000"


def test_interleave_with_a_lead_times_each_step_after_its_own_preceding_steps() -> None:
    """ORTModule's peer: each timed step follows that peer's own steps, untimed, in order (the
    indices before it, as its loop would have run them), never another peer's."""
    from benchmarks.timing import interleave

    calls: list[tuple[str, int]] = []
    steps = {name: (lambda index, name=name: calls.append((name, index))) for name in "ab"}
    samples = interleave(steps, 3, first_round=10, lead_seconds=1e-9)
    assert [len(samples[name].times) for name in "ab"] == [3, 3]
    # One lead step each (the steps take far longer than the lead), then the timed one.
    assert calls == [("a", 9), ("a", 10), ("b", 9), ("b", 10),
                     ("b", 10), ("b", 11), ("a", 10), ("a", 11),
                     ("a", 11), ("a", 12), ("b", 11), ("b", 12)]
