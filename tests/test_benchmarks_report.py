"""The benchmark report renders fake figures into a table (no timing, no plotting: fast)."""

from __future__ import annotations

from benchmarks import report


def test_report_table_shows_ratios_and_dashes_for_figures_not_measured() -> None:
    rows = [
        report.Row("bert loss", "eager", 0.3, 1.0, first_step_s=0.5, peak_mib=190.0),
        report.Row(
            "bert loss", "lazygrad", 0.25, 0.83, steps_per_s=4.0, first_step_s=1.5,
            peak_mib=450.0, exports=1, builds=2, hit_rate=0.8,
        ),
    ]
    text = report.markdown(rows, ["how it was measured"])
    lines = text.splitlines()
    assert lines[2].startswith("| workload")
    assert "| 0.83 " in lines[5] and "| 80.0% " in lines[5] and "| 250.0 " in lines[5]
    assert lines[4].count("—") == 5  # eager: no steps/s, graphs ready, exports, builds, hit rate
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
