"""End to end: ``zerorun train`` as a user runs it, with real torchrun-spawned ranks on gloo."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "recipes/tiny.yaml")

pytestmark = pytest.mark.slow


def zerorun(*args: str, cwd: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerorun", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def job_id(output: str) -> str:
    return re.search(r"job ([0-9a-f]{12})", output).group(1)


def survivors(job: str) -> list[int]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("ZERORUN_JOB_ID") == job:
                found.append(proc.pid)
        except (psutil.Error, OSError):
            pass
    return found


def read_events(run_root) -> list[dict]:
    [metrics] = list(run_root.glob("*/*/metrics.jsonl"))
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def test_tiny_recipe_trains_on_two_ranks(tmp_path):
    out = zerorun("train", TINY, f"log.dir={tmp_path / 'runs'}", cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    events = read_events(tmp_path / "runs")
    steps = {r: [e for e in events if e["event"] == "step" and e["rank"] == r] for r in (0, 1)}
    for rank in (0, 1):
        assert [e["step"] for e in steps[rank]] == [1, 5, 10, 15, 20, 25, 30]
        assert {e["rank"] for e in events if e["event"] in ("start", "finish")} == {0, 1}
        for e in steps[rank]:
            assert e["rss_bytes"] > 0 and e["peak_rss_bytes"] >= e["rss_bytes"] * 0.5
            assert e["samples_per_s"] > 0 and e["tokens_per_s"] == pytest.approx(e["samples_per_s"] * 32, rel=1e-6)
            assert set(e["model_state_bytes"]) == {"params", "grads", "optimizer"}
            assert e["tflops"] > 0 and e["host_mem_bytes"] >= e["host_mem_used_bytes"] > 0
            assert e["interval_s"] >= e["step_time_s"] and 0 <= e["comm_wait_s"] <= e["interval_s"]
        assert [e["interval_steps"] for e in steps[rank]] == [1, 4, 5, 5, 5, 5, 5]
        # issue 37: what the rank does before its first step (Note [Rank phases]), and its CPU use
        assert [e["phase"] for e in events if e["event"] == "phase" and e["rank"] == rank] == [
            "importing torch", "joining the process group", "building the model", "loading data", "setting up ZeRO",
            "first step"]
        assert all(e["cpu_percent"] >= 0 and 0 <= e["host_cpu_percent"] <= 100 for e in steps[rank])
    assert steps[0][-1]["loss"] < steps[0][0]["loss"] - 1.0  # learned: 5.5 nats -> well below
    assert steps[0][-1]["loss"] == steps[1][-1]["loss"]  # the job-wide mean, identical on every rank
    evals = [e["val_loss"] for e in events if e["event"] == "eval"]
    assert len(evals) == 3 and evals[-1] < evals[0] - 1.0
    assert "validation loss" in out.stdout and survivors(job_id(out.stdout)) == []
    assert "waiting for ranks: first step (all 2 ranks), " in out.stdout  # the slowest rank's phase, plain
    assert re.search(r"localhost\s+1\s+done\s+30\s", out.stdout)  # the summary table, not a terminal: plain
    [run_dir] = list((tmp_path / "runs").glob("*/*/"))
    shown = zerorun("show", str(run_dir), cwd=ROOT)
    assert shown.returncode == 0 and re.search(r"steps\s+30/30", shown.stdout), shown.stdout + shown.stderr
    assert re.search(r"localhost\s+0\s+done\s+30\s", shown.stdout) and "final validation loss" in shown.stdout
    latest = zerorun("show", str(run_dir.parent), cwd=ROOT)  # runs/<name>: its latest run (issue 18)
    assert latest.stdout.startswith(f"zerorun: the latest of 1 run in {run_dir.parent}: ")
    assert latest.stdout.rstrip().endswith("zerorun: the job finished (exit status 0)"), latest.stdout


def test_the_bytes_of_an_evaluation_are_not_a_steps(tmp_path):
    """At stage 3 an evaluation's forwards all-gather the units; a step event's ``comm_bytes`` and
    ``comm_bytes_inter_node`` are the step's alone, every step the same (before: the step after each evaluation
    carried its all-gathers, one more pass over the model, and the summary's mean per step with them)."""
    out = zerorun("train", TINY, "zero.stage=3", "train.steps=6", "train.eval_every=2", "log.every=1",
                  f"log.dir={tmp_path / 'runs'}", cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    events = read_events(tmp_path / "runs")
    assert len([e for e in events if e["event"] == "eval"]) == 4  # steps 0, 2, 4, 6
    for rank in (0, 1):
        sent = [e["comm_bytes"] for e in events if e["event"] == "step" and e["rank"] == rank]
        assert len(sent) == 6 and len(set(sent)) == 1 and sent[0] > 0, sent


def test_live_dashboard_in_a_terminal(tmp_path):
    """Under a pseudo-terminal the launcher draws the live view, then leaves the summary in the scrollback."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 140, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "zerorun", "train", TINY, "train.steps=10", "train.eval_every=5",
                             "log.every=2", f"log.dir={tmp_path / 'runs'}"], cwd=ROOT, stdin=subprocess.DEVNULL,
                            stdout=slave, stderr=slave, env={**os.environ, "TERM": "xterm-256color"})
    os.close(slave)
    chunks = []
    try:
        while True:
            chunk = os.read(master, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    except OSError:  # EIO: the launcher closed the terminal
        pass
    assert proc.wait(timeout=240) == 0
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode("utf-8", "replace"))
    assert "zerorun · tiny" in text and "ZeRO stage 2 · fp32 · 2 ranks on localhostx2" in text
    assert "step 10/10" in text and re.search(r"localhost\s+1\s+10\s+\d+\.\d{4}\s+[\d.k]+/s\s+\d+ ms", text)
    assert "zerorun · tiny · summary" in text and "zerorun: done in" in text
    events = read_events(tmp_path / "runs")
    assert {e["rank"] for e in events if e["event"] == "step" and e["step"] == 10} == {0, 1}


BROKEN_FORWARD = """
import os, torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(4, 4)
        self.calls = 0
    def forward(self, batch):
        self.calls += 1
        {body}
def build_model():
    return M()
"""


def recipe_for(tmp_path, model_code: str, **train) -> str:
    (tmp_path / "model.py").write_text(textwrap.dedent(model_code))
    steps = train.get("steps", 6)
    (tmp_path / "r.yaml").write_text(textwrap.dedent(f"""\
        name: broken
        model: {{module: {tmp_path / 'model.py'}}}
        data: {{paths: ["{{stdlib}}/json/*.py"], seq_len: 8}}
        train: {{steps: {steps}, micro_batch_size: 2}}
        launch: {{procs_per_node: {train.get('procs', 2)}}}
        log: {{every: 1, dir: {tmp_path / 'runs'}}}
        """))
    return str(tmp_path / "r.yaml")


def test_failing_rank_stops_the_job_and_is_named(tmp_path):
    body = ("if int(os.environ['RANK']) == 1 and self.calls == 3: raise RuntimeError('boom on purpose')\n"
            "        return self.w(batch.float()[:, :4]).pow(2).mean()")
    recipe = recipe_for(tmp_path, BROKEN_FORWARD.format(body=body), steps=200)
    t0 = time.time()
    out = zerorun("train", recipe, cwd=str(tmp_path))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "rank 1" in out.stderr and "RuntimeError: boom on purpose" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert time.time() - t0 < 60
    assert survivors(job_id(out.stdout)) == []


def test_rank_dying_without_an_exception_is_blamed_not_its_peer(tmp_path):
    """Rank 1 exits with code 7 mid-step; rank 0 then fails inside a collective ("connection reset by peer").
    The job must name rank 1 and its exit code, not rank 0 (Note [Blame])."""
    body = ("if int(os.environ['RANK']) == 1 and self.calls == 3: os._exit(7)\n"
            "        return self.w(batch.float()[:, :4]).pow(2).mean()")
    out = zerorun("train", recipe_for(tmp_path, BROKEN_FORWARD.format(body=body), steps=200), cwd=str(tmp_path))
    assert out.returncode == 1
    assert "rank 1 on localhost: rank process ended (exit code 7)" in out.stderr, out.stderr
    assert survivors(job_id(out.stdout)) == []


def test_ranks_that_exit_before_training_are_a_failure(tmp_path):
    out = zerorun("train", recipe_for(tmp_path, "import os\nos._exit(0)\n", procs=1), cwd=str(tmp_path))
    assert out.returncode == 1 and "rank 0" in out.stderr and "exited before finishing" in out.stderr, out.stderr


def test_diverged_loss_fails_the_job(tmp_path):
    body = "return self.w(batch.float()[:, :4]).pow(2).mean() * float('nan')"
    out = zerorun("train", recipe_for(tmp_path, BROKEN_FORWARD.format(body=body), procs=1), cwd=str(tmp_path))
    assert out.returncode == 1 and "FloatingPointError: the loss is nan at step 1" in out.stderr, out.stderr


def test_error_in_user_forward_names_its_line(tmp_path):
    body = "raise RuntimeError('forward boom')"
    out = zerorun("train", recipe_for(tmp_path, BROKEN_FORWARD.format(body=body), procs=1), cwd=str(tmp_path))
    assert out.returncode == 1 and re.search(r"RuntimeError: forward boom \(at .*model\.py:\d+ in forward\)",
                                             out.stderr), out.stderr


# ``launch``: how the case is run. "train": a whole job (the ranks, or the model check beside them, report it);
# "dry-run": ``train --dry-run``, which starts no rank but runs the same model check (zerorun/rank/modelcheck.py)
# through the same CLI and error path: the cases that check finds, but for one of them, are shown that way (a
# whole job costs twice as much); the check's stopping of a whole job is shown by the SyntaxError case here and
# by test_model_errors_are_one_line_and_stop_the_job.
@pytest.mark.parametrize("code,expected,launch", [
    ("import torch\ndef build_model(:\n", r"model\.py: cannot import: SyntaxError", "train"),
    ("import no_such_module_xyz\n", r"model\.py: cannot import: ModuleNotFoundError", "dry-run"),
    ("def other():\n    pass\n", r"model\.py: has no callable 'build_model'", "dry-run"),
    ("def build_modle():\n    pass\n", r"model\.py: has no callable 'build_model' \(did you mean 'build_modle'\?\)",
     "dry-run"),
    ("def build_model():\n    raise ValueError('bad width')\n", r"build_model\(\*\*\{\}\) raised ValueError: bad width",
     "train"),  # the check leaves it to the ranks
    ("def build_model():\n    return 3\n", r"build_model\(\) returned int, not a torch\.nn\.Module", "dry-run"),
    # found by review: --dry-run passed it, the ranks then exited
    ("def build_model():\n    import sys\n    sys.exit(3)\n", r"build_model\(\*\*\{\}\) raised SystemExit: 3 \(a "
     r"factory that parses the command line or exits cannot build the model here\)", "dry-run"),
    (BROKEN_FORWARD.format(body="return {'logits': self.w(batch.float()[:, :4])}"),
     r"model\.py: forward returned dict with no loss", "train"),  # only the ranks run forward
])
def test_bad_model_module_is_one_clear_line(tmp_path, code, expected, launch):
    extra = ["--dry-run"] if launch == "dry-run" else []
    out = zerorun("train", recipe_for(tmp_path, code, procs=1), *extra, cwd=str(tmp_path))
    assert out.returncode == 2, out.stdout + out.stderr
    assert re.search(expected, out.stderr), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


@pytest.mark.parametrize("override,expected", [
    ("model.module=nonexistent_pkg.mod", r"nonexistent_pkg\.mod: cannot import: ModuleNotFoundError"),
    ("model.factory=nope", r"gpt\.py: has no callable 'nope'"),
    ("model.kwargs.bogus=3", r"raised TypeError: GPT\.__init__\(\) got an unexpected keyword argument 'bogus'"),
    ("zero.units=[Nope]", r"recipe: zero\.units: no module of class Nope in the model"),
    # checked beside the launch too (it needs torch); the ranks alone would crash with a TypeError
    ("train.optimizer.bogus=1", r"override 'train\.optimizer\.bogus=1': train\.optimizer\.bogus: AdamW has no "
                                r"argument 'bogus'"),
])
def test_model_errors_are_one_line_and_stop_the_job(tmp_path, override, expected):
    """The launcher builds the model on the meta device beside the launch (Note [Model check beside the launch]
    in zerorun/rank/modelcheck.py): a broken model spec is one line, exit 2, and no process of the job is left;
    also under --dry-run, which starts nothing and makes no run folder (the check is the same for every spec,
    so one spec is tried as a whole job and under --dry-run; the others go through the same check and the same
    CLI error path under --dry-run only, which costs half a job: the check's stopping of a whole job does not
    depend on the spec; train.optimizer.bogus is also tried as a whole job in
    test_a_rank_crash_caused_by_the_recipe_is_reported_as_the_recipe_error)."""
    for extra in ([], ["--dry-run"]) if override.startswith("model.factory") else (["--dry-run"],):
        runs = tmp_path / f"runs{len(extra)}"
        out = zerorun("train", TINY, override, "zero.stage=3", f"log.dir={runs}", *extra, cwd=ROOT,
                      timeout=60)
        assert out.returncode == 2, out.stdout + out.stderr
        assert re.search(expected, out.stderr), out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
        if extra:
            assert not runs.exists()
        else:
            assert survivors(job_id(out.stdout)) == []
            [job] = list(runs.glob("*/*/job.json"))
            assert json.loads(job.read_text())["status"] == "failed"


def test_ctrl_c_stops_every_rank(tmp_path):
    body = "return self.w(batch.float()[:, :4]).pow(2).mean()"
    recipe = recipe_for(tmp_path, BROKEN_FORWARD.format(body=body), steps=100000)
    proc = subprocess.Popen([sys.executable, "-m", "zerorun", "train", recipe], cwd=str(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    header = proc.stdout.readline()
    job = job_id(header)
    for line in proc.stdout:
        if line.startswith("step"):
            break
    assert len(survivors(job)) >= 3  # torchrun and its two workers
    proc.send_signal(signal.SIGINT)
    t0 = time.time()
    proc.wait(timeout=30)
    assert proc.returncode == 130 and time.time() - t0 < 15
    assert "stopped by SIGINT" in proc.stderr.read()
    assert survivors(job) == []
    # issue 18: the views' log tail says the job was interrupted in one line, torchrun's traceback folded away;
    # the run folder's output.log keeps it whole
    from zerorun.telemetry.format import log_lines
    from zerorun.telemetry.state import JobState

    run_dir = re.search(r"run dir (\S+)", header).group(1)
    with open(os.path.join(tmp_path, run_dir, "output.log")) as f:
        logged = f.read().splitlines()
    assert any("death signal" in line for line in logged)  # torchrun's first words on SIGTERM (then its traceback)
    state = JobState(world_size=2)
    for line in logged:
        node, text = re.match(r"\[node (\d+)\] (.*)", line).groups()
        state.add_line(int(node), text)
    state.end()
    tail = log_lines(state.log)
    assert sum("job interrupted: torchrun got SIG" in line for line in tail) == 1, tail
    assert not any(word in line for line in tail for word in ("Traceback", "SignalException", "closing signal"))
    shown = zerorun("show", os.path.join(tmp_path, run_dir), cwd=ROOT)
    assert shown.stdout.rstrip().endswith("zerorun: the job was interrupted (exit status 130): stopped by SIGINT: "
                                          "every rank was terminated"), shown.stdout + shown.stderr


@pytest.mark.parametrize("args,expected", [
    (["train", "missing.yaml"], r"missing\.yaml: cannot read recipe"),
    (["train", TINY, "train.steps=0"], r"override 'train.steps=0': train\.steps: Input should be greater than 0"),
    (["train", TINY, "-H", "nofile"], r"nofile: cannot read hostfile"),
    (["train", TINY, "log.dir=/proc/zerorun-test"], r"log\.dir: cannot create the run directory"),
    (["train", TINY, "--run-dir", "/proc/zerorun-test/run"], r"error: --run-dir: cannot create the run directory"),
    # click's usage errors used to be three lines of their own format
    (["train", TINY, "--num-procs", "0"], r"^zerorun: error: Invalid value for '--nproc-per-node' .*'--num-procs': "
                                          r"'0': expected ranks per node .* \(see '.*zerorun train --help'\)$"),
    (["train", TINY, "--bogus"], r"^zerorun: error: No such option: --bogus \(see '.*zerorun train --help'\)$"),
    (["bench", TINY, "--steps", "0"], r"^zerorun: error: Invalid value for '--steps'"),
])
def test_bad_cli_input_is_one_line_exit_2(tmp_path, args, expected):
    out = zerorun(*args, cwd=ROOT)
    assert out.returncode == 2 and re.search(expected, out.stderr.strip()), out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_hostfile_with_local_host(tmp_path):
    (tmp_path / "hosts").write_text("localhost slots=1\n")
    out = zerorun("train", TINY, "-H", str(tmp_path / "hosts"), "train.steps=3", "train.eval_every=0",
                  f"log.dir={tmp_path / 'runs'}", "launch.env={ZR_TOKEN: s3cret}", cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "1 rank on localhostx1" in out.stdout and "1 rank started" in out.stdout
    assert {e["rank"] for e in read_events(tmp_path / "runs")} == {0}
    # the run folder records the node's launch command (issue 18): real port, values of launch.env never
    [commands] = list((tmp_path / "runs").glob("*/*/commands.sh"))
    text = commands.read_text()
    assert re.search(r"--nproc-per-node=1 --node-rank=0 --master-addr=127\.0\.0\.1 --master-port=[1-9]\d* ", text)
    assert "ZR_TOKEN" in text and "s3cret" not in text and "-m zerorun.rank.worker --recipe-file" in text


def test_a_rank_crash_caused_by_the_recipe_is_reported_as_the_recipe_error(tmp_path):
    """A busy machine can starve the model check (it runs at the lowest priority, beside the ranks): when a rank
    crashes first, the launcher waits for the check and reports the recipe's field, exit 2, not the ranks'
    TypeError. The check is slowed here by an interpreter wrapper (launch.python) that sleeps for it only."""
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/bin/sh\ncase "$*" in *zerorun.rank.modelcheck*) sleep 8;; esac\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    out = zerorun("train", TINY, "train.optimizer.bogus=1", f"launch.python={wrapper}", "train.eval_every=0",
                  f"log.dir={tmp_path / 'runs'}", "--no-dashboard", cwd=ROOT)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr == ("zerorun: error: override 'train.optimizer.bogus=1': train.optimizer.bogus: AdamW has no "
                          "argument 'bogus'\n"), out.stderr


def test_the_getting_started_example_of_your_own_model_and_data(tmp_path):
    """docs/getting-started.md's "Your own model and data" (recipes/examples/regression.*: a new user's review
    found no such example): it trains, run from another folder, and stage 3 gives stage 0's losses."""
    recipe = os.path.join(ROOT, "recipes/examples/regression.yaml")
    losses = {}
    for stage in (0, 3):
        out = zerorun("train", recipe, f"zero.stage={stage}", "train.steps=20", "log.every=1",
                      f"log.dir={tmp_path / str(stage)}", "--no-dashboard", cwd=str(tmp_path))
        assert out.returncode == 0, out.stdout + out.stderr
        [metrics] = (tmp_path / str(stage)).glob("regression/*/metrics.jsonl")
        events = [json.loads(line) for line in metrics.read_text().splitlines()]
        losses[stage] = [e["loss"] for e in events if e["event"] == "step" and e["rank"] == 0]
    assert len(losses[0]) == 20 and losses[0][-1] < losses[0][0]
    assert losses[3] == pytest.approx(losses[0], rel=1e-5)
