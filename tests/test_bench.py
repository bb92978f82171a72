"""``zerorun bench``: metrics from telemetry (pure), and end to end through the ``zerorun train`` launch path."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import io
import re
import subprocess
import sys

import pytest

from zerorun.bench import (Combination, Row, combinations, measure, parse_baselines, parse_stages, percentile,
                           summarize)
from zerorun.errors import ZerorunError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "recipes/tiny.yaml")


def step(rank, n, time_s, samples_per_s, comm, rss=100, states=(10, 20, 30), inter=0):
    return {"event": "step", "rank": rank, "step": n, "step_time_s": time_s, "samples_per_s": samples_per_s,
            "tokens_per_s": samples_per_s * 31, "comm_bytes": comm, "comm_bytes_inter_node": inter,
            "peak_rss_bytes": rss,
            "model_state_bytes": dict(zip(("params", "grads", "optimizer"), states))}


def test_measure_takes_the_slowest_rank_after_warmup():
    events = [{"event": "start", "rank": r, "world_size": 2} for r in (0, 1)]
    events += [step(0, 1, 9.0, 1.0, 999, rss=500), step(1, 1, 9.0, 1.0, 999)]  # warm-up: left out, but RSS counts
    for n, (t0, t1) in enumerate([(0.1, 0.2), (0.3, 0.1), (0.5, 0.4)], start=2):
        events += [step(0, n, t0, 4 / t0, 100 + n), step(1, n, t1, 4 / t1, 200, states=(10, 20, 40))]
    events += [{"event": "finish", "rank": 0, "time_to_first_step_s": 3.0, "peak_rss_bytes": 300},
               {"event": "finish", "rank": 1, "time_to_first_step_s": 4.5, "peak_rss_bytes": 200}]
    m = measure(events, warmup=1)
    assert m["world_size"] == 2
    assert m["step_time_s"] == pytest.approx(0.3)  # per step max over ranks: 0.2, 0.3, 0.5
    assert m["step_time_p90_s"] == pytest.approx(0.5)
    assert m["samples_per_s"] == pytest.approx(8 / 0.3)  # 4 samples per rank per step, 2 ranks
    assert m["tokens_per_s"] == pytest.approx(8 * 31 / 0.3)
    assert m["peak_rss_bytes"] == 500 and m["model_state_bytes"] == 70
    assert m["comm_bytes_per_step"] == 200 and m["time_to_first_step_s"] == 4.5
    with pytest.raises(ValueError, match="no step after the 5 warm-up steps"):
        measure(events, warmup=5)


def test_bytes_to_other_nodes_per_step_beside_bytes_sent_and_null_where_not_observed():
    """``comm_bytes_inter_node_per_step``: the median over steps of the largest ``comm_bytes_inter_node`` any rank
    sent (Note [Nodes of a group]); a baseline's null events give null in the JSON and ``-`` in the tables."""
    from zerorun.bench.output import markdown_table

    zero = [step(r, n, 0.1, 40, 300, inter=[100, 150, 90][n - 1] + r) for n in (1, 2, 3) for r in (0, 1)]
    ddp = [step(r, n, 0.1, 40, 300, inter=None) for n in (1, 2, 3) for r in (0, 1)]
    assert measure(zero, warmup=0)["comm_bytes_inter_node_per_step"] == 101
    assert measure(ddp, warmup=0)["comm_bytes_inter_node_per_step"] is None
    rows = [Row(Combination("a", "ddp"), status="ok", runs=[measure(ddp, warmup=0)]),
            Row(Combination("a", "zero", 3), status="ok", runs=[measure(zero, warmup=0), measure(zero, warmup=2)])]
    summarize(rows)
    assert rows[0].to_json()["metrics"]["comm_bytes_inter_node_per_step"] is None
    assert rows[1].metrics["comm_bytes_inter_node_per_step"] == {"median": 96, "min": 91, "max": 101}
    table = markdown_table(rows, ["ddp"])
    assert "| to other nodes (MiB) |" in table
    assert "| 0.00 | - | " in table.splitlines()[2] and "| 0.00 | 0.00 | " in table.splitlines()[3], table


def test_markdown_says_not_run_for_combinations_an_interrupted_bench_did_not_reach():
    """Found by review: after a Ctrl-C, bench.md listed the combinations never run as "failed:" with no reason,
    where bench.json, bench.csv and the terminal said pending."""
    from zerorun.bench.output import markdown_table

    import io

    from zerorun.bench.run import _run_row, _Screen
    from zerorun.errors import JobFailed

    rows = [Row(Combination("a", "zero", 1), status="failed", reason="stage 1 refused the recipe (logs: x)"),
            Row(Combination("a", "zero", 2)), Row(Combination("a", "zero", 3))]

    def stopped(row):
        e = JobFailed("job: stopped by SIGINT: every rank was terminated")
        e.exit_code = 130
        raise e

    # the combination running at the Ctrl-C is interrupted, not failed (found by review too)
    screen = _Screen(io.StringIO(), rows, [], 1)
    with screen.live_view():
        assert _run_row(rows[1], screen, 1, stopped) is not None
    assert rows[1].status == "interrupted"
    lines = markdown_table(rows, []).splitlines()
    assert lines[2].startswith("| a | | stage 1 | failed: stage 1 refused the recipe |"), lines
    assert lines[3].startswith("| a | | stage 2 | interrupted |"), lines
    assert lines[4].startswith("| a | | stage 3 | not run (pending) |"), lines


def test_percentile_nearest_rank():
    assert percentile([5, 1, 4, 2, 3], 0.9) == 5
    assert percentile(list(range(1, 11)), 0.9) == 9
    assert percentile([7], 0.9) == 7


def run(world, time_s, **extra):
    return {"world_size": world, "step_time_s": time_s, "step_time_p90_s": time_s, "samples_per_s": 4 * world / time_s,
            "tokens_per_s": 1.0, "peak_rss_bytes": 1, "model_state_bytes": 1, "comm_bytes_per_step": 0,
            "time_to_first_step_s": 1.0, **extra}


def test_summarize_repeats_scaling_and_baseline_ratios():
    rows = [Row(Combination("a", "ddp"), runs=[run(1, 0.2)]),
            Row(Combination("a", "zero", 2), runs=[run(1, 0.1), run(1, 0.3), run(1, 0.2)]),
            Row(Combination("b", "ddp"), runs=[run(2, 0.4)]),
            Row(Combination("b", "zero", 2), runs=[run(2, 0.25)]),
            Row(Combination("b", "zero", 3), status="failed", reason="boom")]
    summarize(rows)
    a2 = rows[1].metrics["step_time_s"]
    assert (a2["median"], a2["min"], a2["max"]) == (0.2, 0.1, 0.3)
    assert rows[1].scaling_efficiency == 1.0 and rows[0].scaling_efficiency == 1.0
    assert rows[3].scaling_efficiency == pytest.approx(0.2 / 0.25)  # per-rank throughput against 1 rank
    assert rows[2].scaling_efficiency == pytest.approx(0.5)
    assert rows[1].time_vs == {"ddp": pytest.approx(1.0)} and rows[3].time_vs == {"ddp": pytest.approx(0.625)}
    assert rows[0].time_vs == {} and rows[4].metrics == {} and rows[4].scaling_efficiency is None


def test_every_hostfile_of_the_smallest_world_size_is_weak_scaling_s_base():
    """Found by review: of two hostfiles of 3 ranks, the second got a weak-scaling efficiency of 0.38 against the
    first, though the smallest world size is 1.0 by definition; a larger one is against the first given."""
    rows = [Row(Combination("a", "zero", 2), runs=[run(3, 0.2)]), Row(Combination("b", "zero", 2), runs=[run(3, 0.5)]),
            Row(Combination("c", "zero", 2), runs=[run(6, 0.4)])]
    summarize(rows)
    assert [r.scaling_efficiency for r in rows] == [1.0, 1.0, pytest.approx(0.5)]


def test_two_hostfiles_of_one_file_name_are_told_apart():
    """Found by review: ``a/hosts`` and ``b/hosts`` both showed as ``hosts`` in the tables and progress lines."""
    from zerorun.bench.output import markdown_table

    rows = [Row(c, status="ok", runs=[run(2, 0.2)]) for c in combinations(["a/hosts", "b/hosts", "c/other"], [2], [])]
    assert [r.combo.host_name for r in rows] == ["a/hosts", "b/hosts", "other"]
    summarize(rows)
    assert [line.split(" | ")[0] for line in markdown_table(rows, []).splitlines()[2:]] == ["| a/hosts", "| b/hosts",
                                                                                           "| other"]


def test_combinations_and_flags():
    combos = combinations(["a", "b"], [0, 2], ["ddp"])
    assert [(c.hostfile, c.label) for c in combos] == [("a", "ddp"), ("a", "stage 0"), ("a", "stage 2"),
                                                       ("b", "ddp"), ("b", "stage 0"), ("b", "stage 2")]
    assert "zero.units=[]" in Combination(None, "zero", 2).overrides(9)
    assert "zero.units=[]" not in Combination(None, "zero", 3).overrides(9)
    assert "zero.units=[]" not in Combination(None, "fsdp2").overrides(9)
    assert parse_stages("3,0, 3") == [3, 0] and parse_baselines("fsdp2,ddp") == ["fsdp2", "ddp"]
    assert parse_baselines("") == []
    with pytest.raises(ZerorunError, match=r"--stages 0,4: '4' is not a ZeRO stage"):
        parse_stages("0,4")
    with pytest.raises(ZerorunError, match=r"unknown baseline 'deepspeed'"):
        parse_baselines("ddp,deepspeed")


def test_zero_variants_are_rows_of_stage_3():
    """``--zero-variants``: stage 3 once per ZeRO++ variant (docs/across-nodes.md), each with its overrides; other
    stages once; an unknown variant or one without stage 3 is one line."""
    from zerorun.bench import parse_zero_variants

    combos = combinations(["a"], [2, 3], ["ddp"], variants=parse_zero_variants("flat, hpz+qwz,flat", [2, 3]))
    assert [c.label for c in combos] == ["ddp", "stage 2", "stage 3 flat", "stage 3 hpz+qwz"]
    assert combos[3].overrides(9)[-3:] == ["zero.stage=3", "zero.hierarchy=node", "zero.quantize_weights=int8"]
    assert not any("hierarchy" in o for o in combos[2].overrides(9) + combos[1].overrides(9))
    assert Row(combos[3]).to_json()["variant"] == "hpz+qwz" and Row(combos[1]).to_json()["variant"] is None
    assert parse_zero_variants("", [0]) == []
    assert parse_zero_variants("qgz,hpz+qwz+qgz", [3])[1] == "hpz+qwz+qgz"
    with pytest.raises(ZerorunError, match=r"--zero-variants hpz,qgx: unknown variant 'qgx' \(choose from flat, "):
        parse_zero_variants("hpz,qgx", [3])
    with pytest.raises(ZerorunError, match=r"--zero-variants hpz: variants of stage 3; --stages has no 3"):
        parse_zero_variants("hpz", [0, 2])


def test_an_ssh_file_that_is_no_regular_file_is_said_so(tmp_path):
    """Found by review: ``--ssh-config /dev/null`` (or a folder) was "no such file", though it exists."""
    from zerorun import launch
    from zerorun.errors import ZerorunError

    for flag, args, path in (("--ssh-config", (None, None, None, "/dev/null"), "/dev/null"),
                             ("--ssh-key", (None, None, str(tmp_path), None), str(tmp_path)),
                             ("--ssh-key", (None, None, str(tmp_path / "none"), None), str(tmp_path / "none"))):
        with pytest.raises(ZerorunError) as e:
            launch.ssh_options(*args)
        assert str(e.value) == f"{flag} {path}: " + ("no such file" if path.endswith("none") else "not a regular file")


def test_bench_passes_its_ssh_options_to_every_job(tmp_path, monkeypatch):
    """``zerorun bench --ssh-config FILE`` reaches every job's launch, as ``zerorun train``'s does (before: bench
    had no SSH options; a user's hosts behind an SSH config could not be benched)."""
    from zerorun import launch
    from zerorun.bench import run as bench_run

    seen = []

    class Failed:
        ok = False

        def error(self):
            return RuntimeError("stopped here")

    monkeypatch.setattr(launch, "run_job", lambda *args, **kwargs: seen.append(kwargs.get("ssh")) or Failed())
    (tmp_path / "ssh_config").write_text("Host *\n  StrictHostKeyChecking no\n")
    ssh = launch.ssh_options(None, None, None, str(tmp_path / "ssh_config"))
    with pytest.raises(RuntimeError, match="stopped here"):
        bench_run._measure_job(Row(Combination(None, "zero", 2)), TINY, [], str(tmp_path), 2, 1, ssh)
    assert seen == [ssh]
    assert "--ssh-config" in zerorun("bench", "--help").stdout


def zerorun(*args, timeout=600):
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "zerorun", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def bench_result(root):
    [bench_dir] = list((root / "tiny").glob("bench-*"))
    return bench_dir, json.loads((bench_dir / "bench.json").read_text())


@pytest.mark.parametrize("override,flag", [("train.steps=abc", "--steps"), ("zero.stage=banana", "--stages"),
                                           ("runtime=ddp", "--baseline")])
def test_overrides_of_fields_bench_sets_are_refused(override, flag):
    """They used to be replaced silently by each job's own values, bad values included."""
    from zerorun.bench import check_overrides

    with pytest.raises(ZerorunError, match=re.escape(f"override '{override}': bench sets ") + ".*" + flag):
        check_overrides(["log.dir=/tmp", override])


def test_bad_flags_are_one_line_errors(tmp_path):
    out = zerorun("bench", TINY, "-H", str(tmp_path / "missing"), f"log.dir={tmp_path}")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "missing: cannot read hostfile" in out.stderr
    out = zerorun("bench", TINY, "--stages", "0,5", f"log.dir={tmp_path}")
    assert out.returncode == 2 and "--stages 0,5: '5' is not a ZeRO stage" in out.stderr
    out = zerorun("bench", TINY, "zero.stagee=1", f"log.dir={tmp_path}")  # refused by every combination
    assert out.returncode == 2 and "zero.stagee: unknown field" in out.stderr and out.stderr.count("\n") == 1
    out = zerorun("bench", TINY, "train.optimizer.bogus=1", f"log.dir={tmp_path}")  # torch's: checked in a child
    assert out.returncode == 2 and "train.optimizer.bogus: AdamW has no argument 'bogus'" in out.stderr
    assert out.stderr.count("\n") == 1
    broken = tmp_path / "broken.py"
    broken.write_text("def build(:\n")  # every combination failed on it, one job each, before one line said so
    out = zerorun("bench", TINY, f"model.module={broken}", f"log.dir={tmp_path}")
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "broken.py" in out.stderr, out.stderr
    assert "SyntaxError" in out.stderr or "syntax" in out.stderr.lower(), out.stderr
    assert not list(tmp_path.glob("*/bench-*"))  # nothing ran, nothing written


@pytest.mark.slow
def test_bench_two_hostfiles_two_stages(tmp_path):
    (tmp_path / "one").write_text("localhost slots=1\n")
    (tmp_path / "two").write_text("localhost slots=2\n")
    out = zerorun("bench", TINY, f"log.dir={tmp_path / 'runs'}", "-H", str(tmp_path / "one"),
                  "-H", str(tmp_path / "two"), "--stages", "0,2", "--steps", "2", "--warmup", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    bench_dir, result = bench_result(tmp_path / "runs")
    rows = result["rows"]
    assert [(os.path.basename(r["hostfile"]), r["label"], r["status"], r["metrics"]["world_size"]["median"])
            for r in rows] == [("one", "stage 0", "ok", 1), ("one", "stage 2", "ok", 1),
                               ("two", "stage 0", "ok", 2), ("two", "stage 2", "ok", 2)]
    for r in rows:
        m = {k: v["median"] for k, v in r["metrics"].items()}
        assert m["step_time_s"] > 0 and m["step_time_p90_s"] >= m["step_time_s"]
        assert m["samples_per_s"] == pytest.approx(4 * m["world_size"] / m["step_time_s"])
        assert m["tokens_per_s"] == pytest.approx(32 * m["samples_per_s"])  # seq_len 32
        assert m["peak_rss_bytes"] > 0 and m["time_to_first_step_s"] > 0
        assert (m["comm_bytes_per_step"] > 0) == (m["world_size"] == 2)
        assert r["scaling_efficiency"] > 0 and len(r["runs"]) == 1
    by = {(os.path.basename(r["hostfile"]), r["label"]): r["metrics"] for r in rows}
    # stage 2 partitions gradients and optimizer states over 2 ranks; over 1 rank it holds what stage 0 holds
    assert by["two", "stage 2"]["model_state_bytes"]["median"] < by["two", "stage 0"]["model_state_bytes"]["median"]
    assert by["one", "stage 2"]["model_state_bytes"] == by["one", "stage 0"]["model_state_bytes"]
    with open(bench_dir / "bench.csv", newline="") as f:
        lines = list(csv.DictReader(f))
    assert [(line["runtime"], line["stage"], line["world_size"]) for line in lines] == \
        [("zero", "0", "1"), ("zero", "2", "1"), ("zero", "0", "2"), ("zero", "2", "2")]
    if importlib.util.find_spec("matplotlib"):
        assert (bench_dir / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "needs matplotlib" in out.stdout
    assert "4 of 4 combinations succeeded" in out.stdout and "stage 2" in out.stdout
    # the allocator is part of the comparison: bench.md and bench.json say which one the ranks had, and every
    # rank of every job ran under it (Note [Rank allocator]: tcmalloc where this machine has it, else mimalloc)
    assert "ZERORUN_ALLOCATOR=auto: tcmalloc preloaded" in (bench_dir / "bench.md").read_text()
    assert "MALLOC_MMAP_THRESHOLD_=1048576" in result["rank_env"]
    from zerorun.allocator import find_tcmalloc

    events = [json.loads(line) for f in (tmp_path / "runs").rglob("metrics.jsonl") for line in open(f)]
    starts = [e for e in events if e["event"] == "start"]
    assert len(starts) == 6 and {e["allocator"] for e in starts} == {"tcmalloc" if find_tcmalloc() else "mimalloc"}
    assert re.search(r"zerorun: bench 4/4: stage 2 on two: ok, 2 ranks, \d+ ms/step", out.stdout), out.stdout


@pytest.mark.slow
def test_a_failing_combination_is_recorded_and_the_rest_run(tmp_path):
    (tmp_path / "one").write_text("localhost slots=1\n")
    out = zerorun("bench", TINY, f"log.dir={tmp_path / 'runs'}", "zero.units=[Nope]", "-H", str(tmp_path / "one"),
                  "--stages", "0,3", "--baseline", "ddp", "--steps", "2", "--warmup", "1")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "bench: 1 of 3 combinations failed" in out.stderr and out.stderr.count("\n") == 1
    _, result = bench_result(tmp_path / "runs")
    rows = {r["label"]: r for r in result["rows"]}
    assert list(rows) == ["ddp", "stage 0", "stage 3"]
    assert rows["ddp"]["status"] == rows["stage 0"]["status"] == "ok"
    assert rows["stage 3"]["status"] == "failed" and "no module of class Nope" in rows["stage 3"]["reason"]
    assert rows["stage 3"]["metrics"] == {}
    assert rows["stage 0"]["time_vs_ddp"] > 0


def test_stage_3_only_fields_are_cleared_for_the_other_combinations():
    """A bench of a recipe with stage-3 settings (units, persistence_threshold) compares it with stages 0-2 and
    the baselines: each combination's recipe must load (persistence_threshold used to fail every other one)."""
    from zerorun.recipe import load_recipe

    stage3 = ["zero.stage=3", "zero.units=[Block]", "zero.persistence_threshold=1000"]
    for combo in combinations([None], [0, 1, 2, 3], ["ddp", "fsdp2"]):
        r = load_recipe(TINY, stage3 + combo.overrides(3))
        assert r.zero.persistence_threshold == (1000 if combo.label == "stage 3" else 0), combo.label


def test_the_screen_table_cuts_no_value_at_80_columns():
    """A review: in an 80-column terminal rich's table cut every cell to '…', the ratios against the baselines too
    ('0.…'). Columns of least use go first now (Note [Fitting the width]); a failed or pending row says so."""
    from types import SimpleNamespace as NS

    from rich.console import Console

    from zerorun.bench.output import render_table

    vals = dict(world_size=2, step_time_s=0.1234, step_time_p90_s=0.15, samples_per_s=123.4, tokens_per_s=15000,
                peak_rss_bytes=450 * 2**20, model_state_bytes=3 * 2**20, comm_bytes_per_step=2 * 2**20,
                comm_bytes_inter_node_per_step=None, time_to_first_step_s=12.3)

    def row(label, status="ok"):
        metrics = {k: {"median": x, "min": x, "max": x} for k, x in vals.items()} if status == "ok" else {}
        return NS(combo=NS(label=label, host_name="localhost", hostfile=None), status=status, metrics=metrics,
                  value=vals.__getitem__, scaling_efficiency=1.0, time_vs={"ddp": 1.05, "fsdp2": 0.92}, reason="boom")

    rows = [row("stage 0"), row("stage 3"), row("fsdp2", "failed"), row("stage 2", "pending")]
    for width in (60, 80, 120):
        console = Console(file=io.StringIO(), width=width, record=True)
        console.print(render_table(rows, ["ddp", "fsdp2"], 1, width))
        text = console.export_text()
        assert "…" not in text and max(len(line) for line in text.splitlines()) <= width, text
        assert re.search(r"stage 3\s+123\s+.*123\.4\s+.*1\.05x\s+0\.92x", text), text
        assert "fsdp2 failed" in text and "stage 2 pending" in text and "fsdp2 on localhost failed: boom" in text
