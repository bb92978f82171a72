"""Text printed through rich that is not markup keeps its square brackets (issue 17 item 13): rich drops
``[plot]`` in ``pip install 'zerorun[plot]'`` as an unknown tag when a message is printed as markup."""

from __future__ import annotations

import io
import os
import sys

from rich.console import Console

from zerorun.errors import ZerorunError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "recipes/tiny.yaml")


def test_bench_prints_the_install_hint_and_failures_whole(tmp_path, monkeypatch):
    """The bench's own output: the plot extra's hint (matplotlib hidden), a failed combination's reason, a
    hostfile whose name has brackets and the results folder."""
    import zerorun.launch.run
    from zerorun.bench import run_bench

    def refuse(*args, **kwargs):
        raise ZerorunError("host [gpu-07] refused: see [logs]")

    monkeypatch.setattr(zerorun.launch.run, "prepare", refuse)
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # import matplotlib fails (imported or not): the hint is printed
    hostfile = tmp_path / "hosts[a]"
    hostfile.write_text("localhost slots=1\n")
    out = io.StringIO()
    failed, total, bench_dir = run_bench(TINY, [f"log.dir={tmp_path / '[runs]'}"], [str(hostfile)], [0], [], 1, 0,
                                         1, out=out)
    text = out.getvalue()
    assert (failed, total) == (1, 1)
    assert "pip install 'zerorun[plot]'" in text
    assert "host [gpu-07] refused: see [logs]" in text.replace("\n", "")
    assert "hosts[a]" in text and f"results in {bench_dir}" in text.replace("\n", "")
    # off a terminal, a line per finished combination (issue 18)
    assert "zerorun: bench 1/1: stage 0 on hosts[a]: failed: host [gpu-07] refused: see [logs]\n" in text


def test_estimate_notes_and_names_keep_brackets():
    from zerorun import estimate as est

    result = est.from_arguments(recipe=None, overrides=[], hostfile=None, params="7B", largest_layer=None, nodes=1,
                                procs_per_node=8, precision=None, optimizer=None, device_memory="80GiB",
                                cpu_memory="1TiB", bandwidth="100Gbps", micro_batch=None)
    result.notes.append("install the extra: pip install 'zerorun[plot]'")
    result.recommendation = "stage 3 [see notes]"
    result.setup["device"] = "gpu[0]"
    out = io.StringIO()
    est.render(result, Console(file=out, width=200))
    text = out.getvalue()
    assert "pip install 'zerorun[plot]'" in text and "stage 3 [see notes]" in text and "device gpu[0]" in text


def test_summary_keeps_brackets_in_paths():
    from zerorun.telemetry.summary import print_summary
    from zerorun.telemetry.state import JobState

    state = JobState(name="exp", world_size=1, steps=1)
    state.checkpoints.append({"step": 1, "path": "/data/[exp-1]/ckpt/step-00000001"})
    state.received = 1  # as if the checkpoint event had arrived
    state.end()
    out = io.StringIO()
    print_summary(state, console=Console(file=out, width=200))
    assert "/data/[exp-1]/ckpt/step-00000001" in out.getvalue()
