"""Automatic restarts and lost nodes (issue 37 parts 2 and 3), fast: the restart loop with a stand-in for one
try of the job (launch/restart.py ``run_with_restarts``), ``--nnodes MIN:MAX`` and ``--max-restarts`` on the
command line. The real launcher, ranks killed with SIGKILL and a lost SSH host: test_restart_e2e.py."""

from __future__ import annotations

import json
import os
import sys

import pytest

from zerorun.recipe.hostfile import Host
from zerorun.launch.preflight import PreflightFailed
from zerorun.launch.restart import SAME_FAILURE_LIMIT, keep_global_batch, parse_nnodes, run_with_restarts
from zerorun.launch.outcome import Outcome
from zerorun.recipe import load_recipe
from zerorun.telemetry.events import PREFIX, format_event
from zerorun.telemetry.state import JobState

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "recipes/tiny.yaml")


class Tries:
    """Stands in for one try of the job: returns the given results in turn, recording the hosts of each try and
    the checkpoint it was to resume from."""

    def __init__(self, recipe, run_dir: str, *outcomes) -> None:
        self.recipe, self.run_dir, self.outcomes = recipe, run_dir, list(outcomes)
        self.calls: list[tuple[list[str], int, str | None, int]] = []

    def __call__(self, hosts: list[Host], attempt: int):
        ckpt = self.recipe.checkpoint.resume if self.recipe is not None else None
        accum = self.recipe.train.grad_accum_steps if self.recipe is not None else None
        self.calls.append(([h.name for h in hosts], attempt, ckpt, accum))
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def failed(run_dir: str, message: str = "rank 1 on a: rank process ended (killed by SIGKILL)", step: int = 3,
           code: int = 1, status: str = "failed", host: str | None = None, lost: bool = False) -> Outcome:
    state = JobState(world_size=2)
    state.progress = (step, 0.0)
    return Outcome(status, code, host=host, message=f"{message} (logs: {run_dir})", elapsed_s=1.0, lost=lost,
                   run_dir=run_dir, state=state)


def ok(run_dir: str) -> Outcome:
    return Outcome("ok", 0, elapsed_s=1.0, run_dir=run_dir, state=JobState(world_size=2))


def restarts(run_dir) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [e for e in map(json.loads, open(path).read().splitlines()) if e["event"] == "restart"]


@pytest.fixture
def recipe(tmp_path):
    """tiny with checkpoint.dir set and no checkpoint saved yet."""
    return load_recipe(TINY, [f"checkpoint.dir={tmp_path / 'ck'}", f"log.dir={tmp_path / 'runs'}"],
                       check_optimizer=False)


def test_a_failure_before_the_first_checkpoint_restarts_from_step_0(recipe, tmp_path):
    run_dir = str(tmp_path)
    recipe.checkpoint.resume = "/stale/step-00000002"  # whatever it was: no complete checkpoint in the folder now
    tries = Tries(recipe, run_dir, failed(run_dir), ok(run_dir))
    said: list[str] = []
    result = run_with_restarts(recipe, [Host("a", 2)], tries, max_restarts=2, say=said.append)
    assert result.ok and [c[1] for c in tries.calls] == [0, 1] and tries.calls[1][2] is None
    assert said == ["zerorun: restart 1 of 2 after rank 1 on a: rank process ended (killed by SIGKILL) (last step "
                    "reported: 3); resuming from step 0 (no checkpoint yet)"]
    assert open(os.path.join(run_dir, "output.log")).read() == f"[launcher] {said[0]}\n"
    [event] = restarts(run_dir)
    assert {k: event[k] for k in ("rank", "attempt", "max_restarts", "cause", "failed_step", "resume_step",
                                  "checkpoint")} == {
        "rank": 0, "attempt": 1, "max_restarts": 2, "cause": "rank 1 on a: rank process ended (killed by SIGKILL)",
        "failed_step": 3, "resume_step": 0, "checkpoint": None}


def test_a_failure_after_the_last_steps_checkpoint_is_a_finished_job(recipe, tmp_path, monkeypatch):
    """Nothing left to train (the last step's checkpoint was saved before the failure): the job's outcome is
    ok, exit code 0, with the failed try's run folder and state, and no rank, host or message of the failure."""
    run_dir = str(tmp_path)
    monkeypatch.setattr("zerorun.launch.restart.resume_point", lambda *a: None)
    first = failed(run_dir, host="a", lost=True)
    result = run_with_restarts(recipe, [Host("a", 2)], Tries(recipe, run_dir, first), max_restarts=2, say=print)
    assert (result.status, result.exit_code, result.rank, result.host, result.message, result.lost) == (
        "ok", 0, None, None, "", False)
    assert (result.run_dir, result.state, result.elapsed_s) == (run_dir, first.state, 1.0)


def test_restarts_stop_when_none_are_left_and_the_last_failure_is_the_result(recipe, tmp_path):
    run_dir = str(tmp_path)
    tries = Tries(recipe, run_dir, failed(run_dir, step=1), failed(run_dir, step=2), failed(run_dir, step=4))
    said: list[str] = []
    result = run_with_restarts(recipe, [Host("a", 2)], tries, max_restarts=2, say=said.append)
    assert result is not None and result.exit_code == 1 and len(tries.calls) == 3
    assert said[-1] == "zerorun: no restarts left (launch.max_restarts 2)"
    assert [e["failed_step"] for e in restarts(run_dir)] == [1, 2]


def test_the_same_failure_from_the_same_checkpoint_stops_with_restarts_left(recipe, tmp_path):
    """The step a try reached races with the crash (rank 0's last report): a repeat is the same cause from the
    same starting point, whatever step each try reported."""
    run_dir = str(tmp_path)
    tries = Tries(recipe, run_dir, *[failed(run_dir, "rank 0 on a: ValueError: nan", step=s) for s in (4, 1, 4, 3)])
    said: list[str] = []
    result = run_with_restarts(recipe, [Host("a", 2)], tries, max_restarts=9, say=said.append)
    assert result.exit_code == 1 and len(tries.calls) == SAME_FAILURE_LIMIT
    assert said[-1] == (f"zerorun: the same failure {SAME_FAILURE_LIMIT} times in a row, each try started from step 0 "
                        "(no newer checkpoint saved between them): not restarting")
    # another cause in between is not a repeat
    tries = Tries(recipe, run_dir, failed(run_dir), failed(run_dir), failed(run_dir, "other"), failed(run_dir),
                  failed(run_dir), ok(run_dir))
    assert run_with_restarts(recipe, [Host("a", 2)], tries, max_restarts=9, say=said.append).ok


def _fake_checkpoints(monkeypatch, tmp_path, steps):
    """Complete checkpoints ``step-N`` in checkpoint.dir for ``steps`` (checkpoint_files.check stands in)."""
    from zerorun.checkpoint import files as checkpoint_files
    from zerorun.errors import ZerorunError

    paths = {}
    for step in steps:
        path = tmp_path / "ck" / f"step-{step:08d}"
        path.mkdir(parents=True)
        paths[step] = str(path)

    def check(path):
        if not os.path.isdir(path):
            raise ZerorunError(f"{path}: no checkpoint")
        return {"step": int(os.path.basename(path).split("-")[1])}

    monkeypatch.setattr(checkpoint_files, "check", check)
    return paths


def _saved(run_dir, path, step):
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write(format_event("checkpoint", 0, step=step, path=path)[len(PREFIX):] + "\n")


def test_a_restart_resumes_only_checkpoints_of_its_own_job(recipe, tmp_path, monkeypatch):
    """Another run's checkpoints in the shared checkpoint.dir (steps 12 and 18, and one after the last step)
    are never resumed by a fresh job's restart: before its own first save it starts from step 0, after it
    from its own newest; progress saved between failures is not a repeat."""
    paths = _fake_checkpoints(monkeypatch, tmp_path, [5, 12, 18, 40])
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    tries = Tries(recipe, run_dir, failed(run_dir), failed(run_dir), failed(run_dir), failed(run_dir), ok(run_dir))
    orig = tries.__call__

    def call(hosts, attempt):
        if attempt == 1:
            _saved(run_dir, paths[5], 5)  # this job's own save, in its second try
        return orig(hosts, attempt)

    said: list[str] = []
    assert run_with_restarts(recipe, [Host("a", 2)], call, max_restarts=9, say=said.append).ok
    assert [c[2] for c in tries.calls] == [None, None, paths[5], paths[5], paths[5]]
    # a job that resumed step 12 by hand restarts from there while it has saved nothing newer
    recipe.checkpoint.resume = paths[12]
    tries = Tries(recipe, run_dir := str(tmp_path / "run2"), failed(run_dir), ok(run_dir))
    os.makedirs(run_dir)
    assert run_with_restarts(recipe, [Host("a", 2)], tries, max_restarts=1, say=said.append).ok
    assert [c[2] for c in tries.calls] == [paths[12], paths[12]]


@pytest.mark.parametrize("result", [
    failed("r", "recipe: bad", code=2),  # bad input: the same again on every try
    failed("r", "stopped by SIGINT: every rank was terminated", code=130, status="interrupted"),
    failed("r", "stopped by SIGTERM", code=143, status="interrupted"),
])
def test_bad_input_and_interruptions_are_not_restarted(recipe, tmp_path, result):
    tries = Tries(recipe, str(tmp_path), result, ok(str(tmp_path)))
    assert run_with_restarts(recipe, [Host("a", 2)], tries, max_restarts=3, say=print) is result
    assert len(tries.calls) == 1 and restarts(str(tmp_path)) == []


def test_no_restarts_by_default(recipe, tmp_path):
    first = failed(str(tmp_path))
    tries = Tries(recipe, str(tmp_path), first, ok(str(tmp_path)))
    said: list[str] = []
    assert run_with_restarts(recipe, [Host("a", 2)], tries, max_restarts=recipe.launch.max_restarts,
                             say=said.append) is first
    assert said == [] and recipe.launch.max_restarts == 0 and recipe.launch.min_nodes is None


def test_a_host_failing_preflight_on_restart_is_left_out_with_min_nodes(recipe, tmp_path):
    """Two hosts of 2 ranks with 3 accumulation steps (global batch 12 micro-batches): on one host 6 steps."""
    run_dir = str(tmp_path)
    recipe.train.grad_accum_steps = 3
    down = PreflightFailed({"b": "cannot connect (connection refused)"})
    tries = Tries(recipe, run_dir, failed(run_dir, "rank 3 on b: rank process ended (killed by SIGKILL)"), down,
                  ok(run_dir))
    said: list[str] = []
    result = run_with_restarts(recipe, [Host("a", 2), Host("b", 2)], tries, max_restarts=1, min_nodes=1,
                               say=said.append)
    assert result.ok and [(c[0], c[1], c[3]) for c in tries.calls] == [
        (["a", "b"], 0, 3), (["a", "b"], 1, 3), (["a"], 1, 6)]
    assert said[-1] == ("zerorun: leaving out b (cannot connect (connection refused)): continuing on 1 of 2 hosts; "
                        "train.grad_accum_steps 3 -> 6 keeps the global batch at 48 samples")


def test_a_lost_node_is_left_out_and_too_few_hosts_end_the_job(recipe, tmp_path):
    run_dir = str(tmp_path)
    lost = failed(run_dir, "node 1 on b ended (lost the SSH connection to b)", host="b", lost=True)
    tries = Tries(recipe, run_dir, lost, ok(run_dir))
    said: list[str] = []
    assert run_with_restarts(recipe, [Host("a", 1), Host("b", 1)], tries, max_restarts=1, min_nodes=1,
                             say=said.append).ok
    assert [c[0] for c in tries.calls] == [["a", "b"], ["a"]] and recipe.train.grad_accum_steps == 2
    # min_nodes 2: one host left is too few; the job's failure is the result
    tries = Tries(recipe, run_dir, lost, ok(run_dir))
    assert run_with_restarts(recipe, [Host("a", 1), Host("b", 1)], tries, max_restarts=1, min_nodes=2,
                             say=said.append) is lost
    assert said[-1] == ("zerorun: lost b (its node was lost): 1 host left, fewer than launch.min_nodes 2: not "
                        "restarting") and len(tries.calls) == 1


def test_preflight_failing_on_restart_without_min_nodes_ends_with_the_jobs_failure(recipe, tmp_path):
    run_dir = str(tmp_path)
    first = failed(run_dir)
    tries = Tries(recipe, run_dir, first, PreflightFailed({"b": "cannot connect"}))
    said: list[str] = []
    assert run_with_restarts(recipe, [Host("a", 1), Host("b", 1)], tries, max_restarts=1, say=said.append) is first
    assert said[-1] == "zerorun: restart 1 cannot start:\npreflight: b: cannot connect"
    with pytest.raises(PreflightFailed):  # the first try: the hosts as given must answer, as ever
        run_with_restarts(recipe, [Host("a", 1)], Tries(recipe, run_dir, PreflightFailed({"a": "x"})),
                          max_restarts=1, min_nodes=1, say=said.append)


@pytest.mark.parametrize("accum,old,new,expected,line", [
    (1, 4, 2, 2, "train.grad_accum_steps 1 -> 2 keeps the global batch at 16 samples"),
    (2, 2, 2, 2, None),
    (1, 3, 2, 2, "the global batch of 12 samples (3 ranks x 1 accumulation steps) does not divide over 2 ranks: "
                 "train.grad_accum_steps 1 -> 2, global batch 16 samples (the loss curve changes)"),
    (1, 8, 3, 3, "the global batch of 32 samples (8 ranks x 1 accumulation steps) does not divide over 3 ranks: "
                 "train.grad_accum_steps 1 -> 3, global batch 36 samples (the loss curve changes)"),
])
def test_global_batch_kept_by_accumulation_where_it_divides(recipe, accum, old, new, expected, line):
    recipe.train.grad_accum_steps = accum  # micro_batch_size 4
    assert keep_global_batch(recipe.train, old, new) == line and recipe.train.grad_accum_steps == expected


@pytest.mark.parametrize("text,parsed", [("2", (None, 2)), ("1:2", (1, 2)), ("2:2", (2, 2))])
def test_nnodes_takes_torchruns_forms(text, parsed):
    assert parse_nnodes(text) == parsed


def cli(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    from zerorun import cli as zcli

    monkeypatch.setattr(sys, "argv", ["zerorun", *args])
    with pytest.raises(SystemExit) as e:
        zcli.main()
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize("args,error", [
    (["--nnodes", "2:1"], "zerorun: error: --nnodes 2:1: expected 1 <= MIN <= MAX (node counts)\n"),
    (["--nnodes", "0:1"], "zerorun: error: --nnodes 0:1: expected 1 <= MIN <= MAX (node counts)\n"),
    (["--nnodes", "x"], "zerorun: error: --nnodes x: expected N or MIN:MAX, node counts (e.g. 2 or 1:2)\n"),
    (["--nnodes", "1:2", "--num-nodes", "1"], "zerorun: error: --nnodes 1:2 and --num-nodes 1: give one node count\n"),
    # the flag the user gave, not its value under another name (was "--num-nodes 5: only 2 host(s) selected")
    (["--nnodes", "2:5"], "zerorun: error: --nnodes 2:5: only 2 host(s) selected\n"),
    (["launch.min_nodes=3"], "zerorun: error: launch.min_nodes 3: more than the job's 2 hosts\n"),
    (["launch.max_restarts=-1"], "launch.max_restarts"),
    (["--max-restarts", "-1"], "--max-restarts"),
])
def test_bad_restart_options_are_one_line(monkeypatch, capsys, tmp_path, args, error):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.2 slots=1\n127.0.0.3 slots=1\n")
    code, err = cli(monkeypatch, capsys, "train", TINY, "-H", str(hosts), "--dry-run", *args)
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("zerorun: error: ") and error in err, err


def test_every_try_shares_the_run_folder_job_id_and_start_and_only_the_first_has_the_model_check(recipe, tmp_path,
                                                                                                 monkeypatch):
    """launch/restart.py ``run_training`` around run_job: the job's start (job.json, ``zerorun show``'s times) is
    the first try's, not the last's."""
    from zerorun.launch import restart

    calls = []

    def run_job(job, hosts, **kwargs):
        calls.append(kwargs)
        result = (failed if len(calls) == 1 else ok)(str(tmp_path / "run"))
        result.state.started = 100.0 + len(calls) if kwargs["started"] is None else kwargs["started"]
        return result

    monkeypatch.setattr("zerorun.launch.run.run_job", run_job)
    recipe.launch.max_restarts = 1
    result = restart.run_training(recipe, [Host("a", 2)], job_id="abc", run_dir=None, recipe_path="r.yaml")
    assert result.ok and result.state.started == 101.0
    assert [(c["run_dir"], c["started"], c["model_check"], c["job_id"]) for c in calls] == [
        (None, None, True, "abc"), (str(tmp_path / "run"), 101.0, False, "abc")]


def test_launch_max_restarts_runs_a_failed_script_again(monkeypatch, capsys, tmp_path):
    """``zerorun launch --max-restarts 1 script.py``: the script's job is run again after a failure, in the same
    run folder (a script resumes itself, as under torchrun); without the option it is not."""
    script = tmp_path / "s.py"
    script.write_text("print('hi')\n")
    calls = []

    def run_job(job, hosts, **kwargs):
        calls.append((job.target, kwargs["run_dir"]))
        return (failed if len(calls) == 1 else ok)(str(tmp_path / "run"))

    monkeypatch.setattr("zerorun.launch.run.run_job", run_job)
    from zerorun import cli as zcli

    monkeypatch.setattr(sys, "argv", ["zerorun", "launch", "--max-restarts", "1", str(script)])
    assert zcli.main() is None and calls == [(str(script), None), (str(script), str(tmp_path / "run"))]
    # a script resumes itself: the line does not claim a step (a review: "resuming from step 0 (no checkpoint yet)"
    # before a script that resumed from its own step 6)
    assert ("zerorun: restart 1 of 1 after rank 1 on a: rank process ended (killed by SIGKILL) (last step reported: "
            "3); the script started again, as it is\n") in capsys.readouterr().out
    calls.clear()
    code, err = cli(monkeypatch, capsys, "launch", str(script))
    assert code == 1 and len(calls) == 1 and "rank process ended (killed by SIGKILL)" in err
