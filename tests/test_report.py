"""zerorun.report(), the telemetry call for users' own scripts, and how the plain view shows its events."""

import io

import zerorun
from zerorun.telemetry import report as report_module
from zerorun.telemetry.console import PlainView
from zerorun.telemetry.events import parse_line


def test_report_emits_step_events_with_rates_that_the_view_shows(monkeypatch, capfd):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    times = iter([100.0, 101.0, 103.0])
    monkeypatch.setattr(report_module.time, "perf_counter", lambda: next(times))
    monkeypatch.setattr(report_module, "_last", {})
    zerorun.report(1, 2.5, steps=10, samples=8, lr=0.1)
    zerorun.report(2, 2.0, steps=10, samples=8, lr=0.1)
    zerorun.report(4, 1.5, steps=10, samples=8)  # two steps in 2 s: 1 s per step
    first, second, third = (parse_line(line) for line in capfd.readouterr().out.splitlines())
    assert first.kind == "step" and first.rank == 3 and first.data["step"] == 1 and "step_time_s" not in first.data
    assert second.data["step_time_s"] == 1.0 and second.data["samples_per_s"] == 8.0
    assert second.data["job_samples_per_s"] == 32.0 and second.data["lr"] == 0.1
    assert third.data["step_time_s"] == 1.0 and third.data["rss_bytes"] > 0 and third.data["peak_rss_bytes"] > 0

    out = io.StringIO()
    view = PlainView(out)
    for event in (first, second, third):
        event.rank = 0
        view.event(event)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step  1/10  loss 2.5000  lr 1.00e-01  rss ")  # fields left out are skipped
    assert lines[1].startswith("step  2/10  loss 2.0000  lr 1.00e-01  1000 ms/step  32.0 samples/s  rss ")
    assert lines[2].startswith("step  4/10  loss 1.5000  1000 ms/step  32.0 samples/s  rss ")
