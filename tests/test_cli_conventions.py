"""The command line a new user meets (issue 18): a fast first line (no torch in the launcher), --version, -h,
a bare ``zerorun``, torchrun's habits in ``zerorun launch``, ``--dry-run`` commands that run as printed, and
the launch command recorded in the run folder. Fast: no rank is started here except where marked slow."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "recipes/tiny.yaml")


def zerorun(*args: str, cwd: str = ROOT, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerorun", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def test_the_launcher_never_imports_torch(tmp_path):
    """Every launcher step of train (also --resume with nothing to resume), launch, bench, show and estimate
    --params (with its disk-offload rows), in one process: importing torch took 2-5 s before the first line
    (the recipe's optimizer check imported it; estimate's disk rows and --resume's lookup too)."""
    (tmp_path / "s.py").write_text("print('hi')\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"v": 1, "event": "start", "rank": 0, "time": 1.0, "world_size": 1}\n'
                                       '{"v": 1, "event": "step", "rank": 0, "time": 2.0, "step": 1, "loss": 2.5}\n')
    code = textwrap.dedent(f"""
        import io, sys, contextlib
        from zerorun import bench, cli, launch
        from zerorun.cli import env
        from zerorun.rank import modelcheck
        from zerorun.recipe import load_recipe
        r = load_recipe({TINY!r}, ["zero.stage=3"], check_optimizer=False)
        hosts = launch.select(None, r.launch.procs_per_node)
        launch.dry_run(r, hosts)
        launch.dry_run(launch.Script({str(tmp_path / 's.py')!r}), hosts)
        launch.run.prepare(r, hosts).close()
        with contextlib.redirect_stdout(io.StringIO()):
            cli.app(args=["estimate", "--params", "7B", "--procs-per-node", "8"], standalone_mode=False)  # + disk
            from zerorun.checkpoint.resume import LATEST, prepare_resume  # --resume on a first run: nothing to load
            first = load_recipe({TINY!r}, ["log.dir={tmp_path / 'runs'}", "checkpoint.every=2"], check_optimizer=False)
            prepare_resume(first, LATEST)
            assert first.checkpoint.resume is None and first.checkpoint.dir.endswith("checkpoints")
            cli.app(args=["launch", "--dry-run", "--nproc-per-node", "2", {str(tmp_path / 's.py')!r}],
                    standalone_mode=False)
            cli.app(args=["show", {str(run)!r}], standalone_mode=False)
        print("torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout


def test_version_help_and_a_bare_zerorun():
    from zerorun import __version__

    out = zerorun("--version")
    assert (out.returncode, out.stdout, out.stderr) == (0, f"zerorun {__version__}\n", "")
    for args in (["-h"], ["train", "-h"], ["launch", "-h"]):
        out = zerorun(*args)
        assert out.returncode == 0 and "Usage:" in out.stdout and out.stderr == "", (args, out.stderr)
    out = zerorun()  # used to end with an empty "zerorun: error:" line and exit 2
    assert out.returncode == 0 and "Usage:" in out.stdout and "train" in out.stdout, out.stdout
    assert out.stderr == "", out.stderr


def dry_run_lines(out: subprocess.CompletedProcess) -> list[list[str]]:
    assert out.returncode == 0, out.stdout + out.stderr
    return [shlex.split(line) for line in out.stdout.splitlines() if line and not line.startswith("#")]


def test_launch_takes_torchruns_options(tmp_path):
    (tmp_path / "s.py").write_text("print('hi')\n")
    out = zerorun("launch", "--nproc-per-node", "3", "--nnodes", "1", "--master-addr", "127.0.0.1",
                  "--master-port", "29533", "--dry-run", "s.py", "--lr", "3e-4", "--nproc-per-node", "9",
                  cwd=str(tmp_path))
    [cmd] = dry_run_lines(out)
    assert "--nproc-per-node=3" in cmd and "--master-addr=127.0.0.1" in cmd and "--master-port=29533" in cmd
    # options after the script are the script's
    assert cmd[cmd.index("zerorun.rank.script_worker") + 1:] == [str(tmp_path / "s.py"), "--lr", "3e-4",
                                                           "--nproc-per-node", "9"]
    out = zerorun("launch", "--standalone", "--nproc_per_node=2", "--master_port=29534", "--dry-run", "-m",
                  "pkg.train", "-x", cwd=str(tmp_path))  # --standalone: torchrun's one-machine idiom (review)
    [cmd] = dry_run_lines(out)
    assert "--nproc-per-node=2" in cmd and "--master-port=29534" in cmd
    assert cmd[cmd.index("zerorun.rank.script_worker") + 1:] == ["-m", "pkg.train", "-x"]


@pytest.mark.parametrize("args,expected", [
    (["launch", "--bogus", "s.py"], r"No such option: --bogus"),  # was: "--bogus: no such script"
    (["launch", "--nproc-per-node", "0", "s.py"], r"^zerorun: error: Invalid value for '--nproc-per-node'"),
    (["launch", "missing.py"], r"missing\.py: no such script"),
    *[(["launch", opt, "x", "s.py"], rf"No such option: {opt}: a torchrun option; {why}")  # "No such option" alone
      for opt, why in (("--rdzv-endpoint", "no rendezvous to set up: zerorun starts every node itself"),
                       ("--node_rank", "a node's rank is its place in the hostfile"),
                       ("--tee", "every rank's output is on the console and in output.log"))],
    (["launch", "sub"], r"sub: a folder, not a script \(give the \.py file, or -m for a module\)"),  # "no such script"
    (["launch", "--standalone", "-H", "hosts", "s.py"], r"--standalone runs on this machine alone"),
    # was "Input should be greater than or equal to 1" for nan, and inf was taken
    # and 1e10 was a traceback (OverflowError in the preflight's thread joins)
    *[(["launch", "--preflight-timeout", bad, "s.py"], rf"'--preflight-timeout': expected seconds from 1 to 86400 "
       rf"\(a day\); got {shown}") for bad, shown in (("nan", "nan"), ("inf", "inf"), ("0.5", "0.5"),
                                                     ("1e10", "1e\\+10"), ("86401", "86401"))],
])
def test_launch_options_before_the_script_are_never_the_script(tmp_path, args, expected):
    import re

    (tmp_path / "s.py").write_text("print('hi')\n")
    (tmp_path / "sub").mkdir()
    out = zerorun(*args, cwd=str(tmp_path))
    assert out.returncode == 2 and re.search(expected, out.stderr), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


def test_train_dry_run_prints_commands_that_run_as_printed(tmp_path):
    """A real master port (was --master-port=0), the private folder and the recipe file named (were
    ``{node_dir}`` and ``<recipe>``); launch.env values are never printed, only their names."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(open(TINY).read().replace("launch: {procs_per_node: 2}",
                                                "launch: {procs_per_node: 2, env: {TOKEN: s3cret}}")
                      .replace("module: models/gpt.py", f"module: {os.path.join(ROOT, 'recipes/models/gpt.py')}"))
    out = zerorun("train", str(recipe), "--dry-run", timeout=120)
    [cmd] = dry_run_lines(out)
    assert "s3cret" not in out.stdout and "TOKEN" in out.stdout
    assert cmd[:2] == ["cd", ROOT] and 'TOKEN=$TOKEN' in out.stdout.replace('"', "")
    port = int(next(a for a in cmd if a.startswith("--master-port=")).split("=")[1])
    assert port > 0 and "{node_dir}" not in out.stdout and "<recipe>" not in out.stdout
    recipe_file = cmd[cmd.index("--recipe-file") + 1]
    assert stat.S_IMODE(os.stat(recipe_file).st_mode) == 0o600
    # the file stays behind in /tmp: launch.env values masked there; the rank takes them from its environment
    folder = os.path.dirname(recipe_file)
    for name in os.listdir(folder):
        assert b"s3cret" not in open(os.path.join(folder, name), "rb").read(), name
    from zerorun.recipe import MASK
    from zerorun.rank.worker import read_recipe

    assert json.load(open(recipe_file))["launch"]["env"] == {"TOKEN": MASK}
    recipe = read_recipe(recipe_file, {"TOKEN": "s3cret"})
    assert recipe.name == "tiny" and recipe.launch.env == {"TOKEN": "s3cret"}


def test_script_worker_runs_a_module_as_python_m(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "job.py").write_text("import sys\nprint('argv', sys.argv[1:], __name__)\n")
    out = subprocess.run([sys.executable, "-m", "zerorun.rank.script_worker", "-m", "pkg.job", "--lr", "1"],
                         cwd=str(tmp_path), capture_output=True, text=True, timeout=60,
                         env={**os.environ, "RANK": "0", "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    assert "[rank 0] argv ['--lr', '1'] __main__" in out.stdout


@pytest.mark.slow
def test_launch_dry_run_command_runs_as_printed(tmp_path):
    (tmp_path / "s.py").write_text("import os, sys\nprint('rank', os.environ['RANK'], sys.argv[1:])\n")
    out = zerorun("launch", "--nproc-per-node", "2", "--dry-run", "s.py", "--x", "1", cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    ran = subprocess.run(["sh", "-c", out.stdout], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "[rank 0] rank 0 ['--x', '1']" in ran.stdout and "[rank 1] rank 1 ['--x', '1']" in ran.stdout


def test_a_crash_at_the_moment_the_model_check_ends_reports_the_checks_line(tmp_path):
    """CI found the race: the ranks crashed on a bogus optimizer argument in the same poll as the model check
    ended with its line; the supervisor saw the crash first and the check, already done, was never read: exit 1
    with the rank's TypeError instead of exit 2 naming train.optimizer."""
    import tempfile

    from zerorun.launch.run import prefer_check
    from zerorun.launch.outcome import Outcome as JobResult
    from zerorun.rank.modelcheck import PREFIX, ModelCheck

    err = tempfile.TemporaryFile()
    line = "train.optimizer.bogus: AdamW has no argument 'bogus'"
    proc = subprocess.Popen([sys.executable, "-c", f"import sys; sys.stderr.write({PREFIX + line!r}); sys.exit(2)"],
                            stderr=err)
    proc.wait()
    check = ModelCheck(proc, err)
    assert check.done  # ended before the supervisor looked at it
    crash = JobResult("failed", 1, 0, "localhost", "TypeError: AdamW.__init__() got an unexpected keyword 'bogus'")
    got = prefer_check(crash, check)
    assert (got.exit_code, got.message, got.rank) == (2, line, None)
    # a crash the check finds nothing about stays the rank's; other results are left as they are
    quiet = tempfile.TemporaryFile()
    fine = ModelCheck(subprocess.Popen([sys.executable, "-c", "pass"], stderr=quiet), quiet)
    assert prefer_check(crash, fine) is crash
    assert prefer_check(JobResult("ok", 0), None).status == "ok"
    # a rank that reported the bad input itself (exit 2, its factory raised) gives the check's line too: the
    # same input printed the rank's message or the check's by which saw it first (review)
    reported = JobResult("failed", 2, 1, "localhost", "m.py: build_model(**{'bogus': 1}) raised TypeError: ...")
    got = prefer_check(reported, check)
    assert (got.exit_code, got.message, got.rank) == (2, line, None)
    assert prefer_check(reported, fine) is reported


def test_dry_run_header_counts_ranks_in_words():
    """``zerorun launch --dry-run s.py`` on one rank said "# job ...: 1 ranks" (review)."""
    from zerorun.recipe.hostfile import Host
    from zerorun.launch.commands import render
    from zerorun.launch.plan import build_plan

    for slots, words in ((1, "1 rank,"), (2, "2 ranks,")):
        plan = build_plan([Host("localhost", slots)], "{}", "job", 12345)
        text = render(plan, "/w", {0: "/tmp/node0"})
        assert text.startswith(f"# job {plan.job_id}: {words} master "), text
        assert ("# node 0 (localhost): rank 0, run here" if slots == 1 else
                "# node 0 (localhost): ranks 0..1, run here") in text, text
