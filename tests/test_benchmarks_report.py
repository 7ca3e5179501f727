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
    assert lines[4].count("—") == 4  # eager: no steps/s, exports, builds, hit rate
    assert "- how it was measured" in lines
