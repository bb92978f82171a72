"""``zerorun attach`` and the SLURM job records (issue 19): reading ``scontrol show job``, how attach finds a
job's run folder and its exit status, following a run folder across requeues. Fast: no cluster here
(tests/test_slurm_submit.py: the batch script; tests/test_slurm_submit_e2e.py runs a real job)."""

from __future__ import annotations

import json
import subprocess

import pytest

from zerorun.errors import ZerorunError
from zerorun.slurm import jobs as slurm_jobs


SCONTROL_LINE = ("JobId=12 JobName=q test UserId=root(0) GroupId=root(0) Priority=1 JobState=PENDING "
                 "Reason=Resources Dependency=(null) ExitCode=0:0 SubmitTime=2026-12-01T00:06:46 "
                 "NodeList=(null) Command=/tmp/a b/submit.sbatch WorkDir=/tmp/x Comment=hello world 50%")


def test_parse_scontrol_show_job():
    info = slurm_jobs.parse_job("12", SCONTROL_LINE)
    assert (info.state, info.reason, info.exit_code, info.nodes) == ("PENDING", "Resources", "0:0", None)
    assert info.active and info.pending and info.submitted is not None
    done = slurm_jobs.parse_job("12", SCONTROL_LINE.replace("JobState=PENDING", "JobState=FAILED")
                                .replace("Reason=Resources", "Reason=NonZeroExitCode")
                                .replace("NodeList=(null)", "NodeList=127.0.0.[11-12]"))
    assert not done.active and done.nodes == "127.0.0.[11-12]"
    with pytest.raises(ZerorunError, match="not a SLURM job id"):
        slurm_jobs.check_job_id("12; rm -rf /")
    assert slurm_jobs.check_job_id(" 123_4 ") == "123_4"


def test_run_folder_from_the_script_and_the_records(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert slurm_jobs.script_run_dir("#!/bin/bash\n#SBATCH -N 2\nRUN_DIR='/a b/c'\nexec x\n") == "/a b/c"
    assert slurm_jobs.script_run_dir('RUN_DIR="$HOME/runs/x"  # edited\n') == str(tmp_path / "home/runs/x")
    assert slurm_jobs.script_run_dir("#!/bin/bash\nzerorun train r.yaml\n") is None
    run = tmp_path / "run"
    run.mkdir()
    slurm_jobs.remember("41", str(run), in_run_dir=True)
    assert slurm_jobs.submitted_job(str(run)) == "41"
    assert slurm_jobs.recorded_run_dir("41") == str(run)
    assert slurm_jobs.recorded_run_dir("42") is None
    later = slurm_jobs.JobInfo("41", "RUNNING", submitted=json.load(open(run / "slurm-job.json"))["submitted"] + 3600)
    assert slurm_jobs.recorded_run_dir("41", later) is None  # a record older than the job: not this job's
    # unknown to SLURM and never recorded: one line naming the id
    with pytest.raises(ZerorunError, match="job 42: unknown to SLURM"):
        slurm_jobs.find_run_dir("42", None)
    assert slurm_jobs.find_run_dir("41", None) == str(run)  # ended long ago: the record


def test_exit_status_from_the_run_or_from_slurm(tmp_path):
    from zerorun.slurm.attach import exit_status

    run = str(tmp_path)
    info = slurm_jobs.JobInfo("1", "CANCELLED", exit_code="0:15")
    assert exit_status(info, run, "1") == 143
    assert exit_status(slurm_jobs.JobInfo("1", "FAILED", exit_code="3:0"), run, "1") == 3
    assert exit_status(slurm_jobs.JobInfo("1", "COMPLETED"), run, "1") == 0
    # stopped from outside (scancel, the time limit) with SLURM's ExitCode 0:0: not a success (review: was 0/1)
    assert exit_status(slurm_jobs.JobInfo("1", "TIMEOUT"), run, "1") == 143
    assert exit_status(slurm_jobs.JobInfo("1", "CANCELLED"), run, "1") == 143
    assert exit_status(slurm_jobs.JobInfo("1", "COMPLETING"), run, "1") == 1  # never final: was 0
    (tmp_path / "job.json").write_text('{"exit_code": 2}')
    assert exit_status(info, run, "1") == 2  # zerorun train's own status wins
    (tmp_path / "job.json").write_text('{"exit_code": 0, "slurm_job_id": "2"}')  # the folder submitted again
    assert exit_status(info, run, "1") == 143 and exit_status(info, run, "2") == 0


def test_attach_to_an_old_job_while_its_folder_runs_again(tmp_path, monkeypatch):
    """`sbatch RUN/submit.sbatch` (job 4) while attach asks for job 3: the new launcher removed job.json and its
    metrics are appended, so the old job is named as ended with SLURM's status and the folder's new job pointed
    at (review: a summary mixing both runs, "did not record how it ended")."""
    import io

    from zerorun.slurm import attach as slurm_attach

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"v": 1, "event": "start", "rank": 0, "time": 1.0}\n')
    slurm_jobs.remember("4", str(run), in_run_dir=True)  # what the new job's zerorun train records
    out = io.StringIO()
    code = slurm_attach._ended("3", str(run), slurm_jobs.JobInfo("3", "CANCELLED", exit_code="143:0"), out)
    assert code == 143 and out.getvalue() == (f"zerorun: job 3 ended (CANCELLED, exit code 143:0); its run folder "
                                              f"now holds job 4's run: zerorun attach 4 ({run})\n")


def test_a_job_that_never_ran_is_not_sent_to_a_missing_output_file(tmp_path):
    """A job cancelled while pending has no slurm-N.out: attach says it ended without pointing at one (review:
    "its output: .../slurm-11.out", a file that does not exist); once the file exists it is named."""
    import io

    from zerorun.slurm import attach as slurm_attach

    cancelled = slurm_jobs.JobInfo("11", "CANCELLED", exit_code="0:0")
    out = io.StringIO()
    assert slurm_attach._ended("11", str(tmp_path), cancelled, out) == 143
    assert out.getvalue() == "zerorun: job 11 ended (CANCELLED, exit code 0:0) before any rank wrote a metric\n"
    (tmp_path / "slurm-11.out").write_text("srun: error\n")
    out = io.StringIO()
    slurm_attach._ended("11", str(tmp_path), cancelled, out)
    assert out.getvalue().endswith(f"metric; its output: {tmp_path / 'slurm-11.out'}\n")
    # a review: the job's own one-line cause (a recipe broken after submit) was only in the file
    (tmp_path / "slurm-11.out").write_text("zerorun: error: old\nnoise\nzerorun: error: bad.yaml:2: invalid YAML\nx\n")
    out = io.StringIO()
    slurm_attach._ended("11", str(tmp_path), slurm_jobs.JobInfo("11", "FAILED", exit_code="2:0"), out)
    assert out.getvalue() == ("zerorun: job 11 ended (FAILED, exit code 2:0) before any rank wrote a metric: "
                              f"bad.yaml:2: invalid YAML; its output: {tmp_path / 'slurm-11.out'}\n")


def test_attach_waits_while_a_signalled_job_completes(tmp_path, monkeypatch):
    """SLURM shows COMPLETING as soon as it signals a job, while zerorun train still saves and writes its
    record: attach waits for the record or the final state (review: it reported COMPLETING, exit 0)."""
    from zerorun.slurm import attach as slurm_attach

    states = iter([slurm_jobs.JobInfo("7", "COMPLETING"), slurm_jobs.JobInfo("7", "CANCELLED", exit_code="0:15")])
    monkeypatch.setattr(slurm_attach, "job_info", lambda job_id: next(states))
    done = slurm_attach.settled("7", str(tmp_path), slurm_jobs.JobInfo("7", "COMPLETING"), 0.01)
    assert done.state == "CANCELLED" and slurm_attach.exit_status(done, str(tmp_path), "7") == 143
    (tmp_path / "job.json").write_text('{"exit_code": 143, "slurm_job_id": "7"}')
    waiting = slurm_jobs.JobInfo("7", "COMPLETING")
    assert slurm_attach.settled("7", str(tmp_path), waiting, 0.01) is waiting  # its record is there: no wait
    # a node stuck in SLURM's clean-up: attach stops waiting after COMPLETING_WAIT_S (review: no bound)
    monkeypatch.setattr(slurm_attach, "job_info", lambda job_id: slurm_jobs.JobInfo("8", "COMPLETING"))
    stuck = slurm_attach.settled("8", str(tmp_path), slurm_jobs.JobInfo("8", "COMPLETING"), 0.01, limit_s=0.1)
    assert stuck.state == "COMPLETING" and slurm_attach.exit_status(stuck, str(tmp_path), "8") == 1


def test_a_job_that_records_no_run_folder_is_named_by_the_state_it_ends_in(monkeypatch):
    """A job of the user's own script that runs no zerorun train: attach names the state it ends in, not SLURM's
    COMPLETING clean-up on the way (found by a suite run: "ended (COMPLETING)", now and then), and a node stuck in
    that clean-up ends the wait after COMPLETING_WAIT_S."""
    from zerorun.slurm import attach as slurm_attach

    def nowhere(job_id, info):
        raise ZerorunError("not zerorun's")

    monkeypatch.setattr(slurm_attach, "find_run_dir", nowhere)
    states = iter([slurm_jobs.JobInfo("9", "RUNNING"), slurm_jobs.JobInfo("9", "COMPLETING"),
                   slurm_jobs.JobInfo("9", "COMPLETING"), slurm_jobs.JobInfo("9", "COMPLETED")])
    monkeypatch.setattr(slurm_attach, "job_info", lambda job_id: next(states))
    with pytest.raises(ZerorunError, match=r"^job 9 ended \(COMPLETED\) and no zerorun train in it recorded"):
        slurm_attach._wait_for_record("9", 0.001)
    monkeypatch.setattr(slurm_attach, "COMPLETING_WAIT_S", 0.05)
    monkeypatch.setattr(slurm_attach, "job_info", lambda job_id: slurm_jobs.JobInfo("9", "COMPLETING"))
    with pytest.raises(ZerorunError, match=r"^job 9 ended \(COMPLETING\)"):
        slurm_attach._wait_for_record("9", 0.001)


def test_attach_follows_a_job_across_slurms_requeue(tmp_path, monkeypatch):
    """Issue 34 item 14: SLURM requeues a running job (COMPLETING with Restarts counted up, its zerorun train
    records exit 143, then PENDING for BeginTime, then a second run that completes). attach exited 143
    "interrupted" while the job was pending; it follows the next run and exits with the job's end, 0. The
    first run's job.json is not taken for the second's end."""
    import io

    from zerorun.slurm import attach as slurm_attach

    run, t0 = tmp_path / "run", 1_700_000_000.0
    run.mkdir()
    job = lambda state, restarts=0, started=t0, **kw: slurm_jobs.JobInfo(  # noqa: E731
        "7", state, restarts=restarts, started=started, nodes="n[1-2]", **kw)

    def first_run_ends():
        (run / "job.json").write_text(json.dumps({"exit_code": 143, "slurm_job_id": "7", "started": t0 + 1}))
        return job("COMPLETING", 1)

    def second_run_ends():
        (run / "job.json").write_text(json.dumps({"exit_code": 0, "slurm_job_id": "7", "started": t0 + 301}))
        return job("COMPLETING", 1, t0 + 300)

    script = [lambda: job("RUNNING"), first_run_ends, lambda: job("COMPLETING", 1),
              lambda: job("PENDING", 1, t0 + 300, reason="BeginTime"), lambda: job("PENDING", 1, t0 + 300),
              lambda: job("RUNNING", 1, t0 + 300), lambda: job("RUNNING", 1, t0 + 300), second_run_ends,
              lambda: job("COMPLETED", 1, t0 + 300)]
    calls = iter(script)
    last = [None]

    def job_info(job_id):
        step = next(calls, None)
        last[0] = step() if step is not None else last[0]
        return last[0]

    monkeypatch.setattr(slurm_attach, "job_info", job_info)
    out = io.StringIO()
    code = slurm_attach.follow_job("7", str(run), job("RUNNING"), dashboard=False, out=out, poll_s=0.01)
    text = out.getvalue()
    assert code == 0, text
    assert "zerorun: SLURM requeued job 7 (restart 1); following its next run" in text
    assert "job 7 is pending (BeginTime)" in text
    # the first run's record while the second one waits or runs: not this run's end
    (run / "job.json").write_text(json.dumps({"exit_code": 143, "slurm_job_id": "7", "started": t0 + 1}))
    assert slurm_attach.job_record(str(run), "7", job("RUNNING", 1, t0 + 300)) == {}
    assert slurm_attach.job_record(str(run), "7", job("RUNNING"))["exit_code"] == 143  # never requeued
    assert slurm_jobs.parse_job("7", "JobId=7 JobState=PENDING Restarts=2 StartTime=2026-12-02T06:01:09").restarts == 2


def test_job_ids_that_scontrol_reads_otherwise_are_refused(monkeypatch):
    with pytest.raises(ZerorunError, match="'0' is not a SLURM job id"):  # scontrol show job 0 lists every job
        slurm_jobs.check_job_id("0")
    assert slurm_jobs.check_job_id(" 9_1 ") == "9_1"
    said = subprocess.CompletedProcess([], 1, stdout="slurm_load_jobs error: Invalid job id specified\n", stderr="")
    monkeypatch.setattr(slurm_jobs, "_scontrol", lambda *a: said)
    assert slurm_jobs.job_info("9_1") is None  # scontrol said it on stdout (review: "(no message)")


def test_follow_feeds_appended_lines_to_the_view(tmp_path):
    from zerorun.telemetry.follow import Tail, follow

    metrics, log = tmp_path / "metrics.jsonl", tmp_path / "output.log"
    seen: list = []

    class View:
        def event(self, e):
            seen.append(("event", e.kind, e.rank))

        def line(self, node_rank, text):
            seen.append(("line", node_rank, text))

    chunks = [(metrics, '{"v": 1, "event": "start", "rank": 0, "time": 1.0}\n{"v": 1, "event": "st'),
              (log, "[node 1] [rank 2] hello\n"),
              (metrics, 'ep", "rank": 1, "time": 2.0, "step": 1, "loss": 2.5}\nnot json\n')]
    polls = []

    def sleep(_):  # each poll appends the next chunk
        if chunks:
            path, text = chunks.pop(0)
            with open(path, "a") as f:
                f.write(text)

    def running():
        polls.append(1)
        return bool(chunks)

    follow(str(tmp_path), View(), running, poll_s=0, check_s=0, sleep=sleep)
    assert seen == [("event", "start", 0), ("line", 1, "[rank 2] hello"), ("event", "step", 1)]
    tail = Tail(str(tmp_path / "missing"))
    assert tail.read() == []
