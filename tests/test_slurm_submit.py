"""``zerorun submit`` (issue 19): the batch script's text, its errors, and the estimate of a submitted layout
(``zerorun attach``: tests/test_slurm_attach.py). Fast: no cluster here (tests/test_slurm_submit_e2e.py runs a
real job)."""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
import sys

import pytest

from zerorun.errors import ZerorunError
from zerorun.slurm import jobs as slurm_jobs
from zerorun.slurm.submit import SubmitOptions, directive_value, group_args, render_script
from zerorun.recipe import load_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "recipes/tiny.yaml")


def zerorun(*args: str, cwd: str = ROOT, env: dict | None = None, timeout: float = 60):
    return subprocess.run([sys.executable, "-m", "zerorun", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


def directives(text: str) -> list[str]:
    """The #SBATCH lines sbatch reads: those before the first line that is neither a comment nor blank."""
    out = []
    for line in text.splitlines()[1:]:
        if line.startswith("#SBATCH"):
            out.append(line[len("#SBATCH "):])
        elif line.strip() and not line.startswith("#"):
            break
    return out


def script(tmp_path, overrides=(), run_dir=None, **options) -> str:
    recipe = load_recipe(TINY, list(overrides), check_optimizer=False)
    return render_script(recipe=recipe, recipe_path=TINY, overrides=list(overrides),
                         options=SubmitOptions(**options), run_dir=run_dir or str(tmp_path / "run"),
                         workdir=str(tmp_path), python=sys.executable)


def test_script_asks_for_the_nodes_and_the_options(tmp_path):
    text = script(tmp_path, nodes=3, procs_per_node=4, time="01:00:00", partition="gpu", account="proj1",
                  job_name="my job")
    assert directives(text) == ['--job-name="my job"', "--nodes=3", "--ntasks-per-node=4", "--time=01:00:00",
                                "--partition=gpu", "--account=proj1",
                                f"--output={tmp_path / 'run' / 'slurm-%j.out'}", "--open-mode=append"]
    # the defaults: the recipe's name and launch.procs_per_node (tiny.yaml: 2), no time/partition/account
    text = script(tmp_path)
    assert directives(text)[:3] == ["--job-name=tiny", "--nodes=1", "--ntasks-per-node=2"]
    assert not any(d.startswith(("--time", "--partition", "--account")) for d in directives(text))
    assert text.startswith("#!/bin/bash\n# zerorun submit: tiny on 1 node x 2 ranks, ZeRO stage")


def test_extra_sbatch_args_become_directives_after_zeroruns(tmp_path):
    text = script(tmp_path, time="00:10:00", sbatch_args=("--time=00:20:00", "-C", "volta a100", "--exclusive",
                                                           "--comment", 'say "hi" \\o/'))
    d = directives(text)
    assert d[-4:] == ["--time=00:20:00", '-C "volta a100"', "--exclusive", '--comment "say \\"hi\\" \\\\o/"']
    assert d.index("--time=00:10:00") < d.index("--time=00:20:00")  # sbatch keeps the last: the user's wins
    assert group_args(["--qos=high", "-N", "2"]) == [["--qos=high"], ["-N", "2"]]
    with pytest.raises(ZerorunError, match="expected an option"):
        group_args(["volta"])


def test_directive_values_are_quoted_as_sbatch_reads_them():
    # checked against sbatch 22.05: a quoted value keeps its spaces, \" and \\ are a quote and a backslash
    assert directive_value("plain-value_1:2") == "plain-value_1:2"
    assert directive_value("a b") == '"a b"'
    assert directive_value('x\\y "q" $HOME') == '"x\\\\y \\"q\\" $HOME"'
    with pytest.raises(ZerorunError, match="line break"):
        directive_value("a\nb")


def test_the_body_runs_zerorun_train_with_the_exact_arguments(tmp_path):
    """Paths with spaces, quotes, ``$`` and ``%`` reach zerorun train unchanged: the script runs under bash with
    a stand-in interpreter that prints its arguments."""
    run_dir = str(tmp_path / "runs dir" / "50% it's $HOME")
    work = tmp_path / "work dir"
    work.mkdir()
    fake = tmp_path / "fake python"
    fake.write_text("#!/bin/sh\nexec \"$REAL\" -c "
                    "'import json, os, sys; print(json.dumps([os.getcwd(), *sys.argv[1:]]))' \"$@\"\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    overrides = ["log.dir=my runs/x", "name=a'b\"c", "zero.stage=3"]
    recipe = load_recipe(TINY, overrides, check_optimizer=False)
    text = render_script(recipe=recipe, recipe_path=TINY, overrides=overrides, options=SubmitOptions(nodes=2),
                         run_dir=run_dir, workdir=str(work), python=str(fake))
    output = next(d for d in directives(text) if d.startswith("--output="))
    assert "%%" in output  # sbatch's file name patterns need a literal % doubled
    path = tmp_path / "submit.sbatch"
    path.write_text(text)
    out = subprocess.run(["bash", str(path)], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "REAL": sys.executable})
    assert out.returncode == 0, out.stderr
    cwd, *argv = json.loads(out.stdout)
    assert cwd == str(work)
    assert argv == ["-m", "zerorun", "train", TINY, "--launcher", "slurm", "--num-procs", "2", "--no-dashboard",
                    "--run-dir", run_dir, *overrides]
    # requeued, it continues its own checkpoints (found by review: refused beside them, or from step 0 before)
    out = subprocess.run(["bash", str(path)], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "REAL": sys.executable, "SLURM_RESTART_COUNT": "1"})
    assert json.loads(out.stdout)[1:] == argv[:11] + ["--resume"] + argv[11:], out.stdout
    assert slurm_jobs.script_run_dir(text) == run_dir  # what attach reads back from the job's script
    # a line break in an override stays inside its quotes and out of the header comment
    overrides = ["name=two\nlines"]
    recipe = load_recipe(TINY, overrides, check_optimizer=False)
    text = render_script(recipe=recipe, recipe_path=TINY, overrides=overrides, options=SubmitOptions(),
                         run_dir=run_dir, workdir=str(work), python=str(fake),
                         command=["zerorun", "submit", *overrides])
    assert all(line.startswith("#") for line in text.split("\n#SBATCH")[0].splitlines())
    path.write_text(text)
    out = subprocess.run(["bash", str(path)], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "REAL": sys.executable})
    assert json.loads(out.stdout)[-1] == "name=two\nlines"


def test_submit_errors_are_one_line(tmp_path):
    env = {**os.environ, "PATH": os.path.dirname(sys.executable)}  # no sbatch there
    runs = tmp_path / "runs"
    out = zerorun("submit", TINY, "--nodes", "2", f"log.dir={runs}", env=env, cwd=str(tmp_path))
    assert out.returncode == 2 and out.stderr.startswith("zerorun: error: sbatch: not found on PATH")
    assert len(out.stderr.splitlines()) == 1 and not runs.exists()  # nothing made before the check
    out = zerorun("submit", TINY, "train.steps=0", "--dry-run", env=env, cwd=str(tmp_path))
    assert out.returncode == 2 and out.stderr == ("zerorun: error: override 'train.steps=0': train.steps: Input "
                                                  "should be greater than 0\n")
    out = zerorun("submit", TINY, "launch.env={TOKEN: s3cret}", "--dry-run", env=env, cwd=str(tmp_path))
    assert out.returncode == 2 and "launch.env" in out.stderr and "s3cret" not in out.stderr + out.stdout
    out = zerorun("submit", TINY, "--dry-run", "--", "volta", env=env, cwd=str(tmp_path))
    assert out.returncode == 2 and "expected an option" in out.stderr


def test_a_job_that_would_save_beside_another_jobs_checkpoints_is_refused_at_submit(tmp_path):
    """Note [One job's checkpoints per folder]: at submit, not after the queue wait (the job's own train would
    refuse it too); with --resume (the latest) it continues them."""
    from zerorun.slurm.submit import submit

    step = tmp_path / "runs" / "tiny" / "checkpoints" / "step-00000010"
    step.mkdir(parents=True)
    (step / "COMPLETE").write_text('{"saved_at": 1.0}')
    overrides = [f"log.dir={tmp_path / 'runs'}", "checkpoint.every=10"]
    with pytest.raises(ZerorunError, match=r"holds a checkpoint of an earlier job \(step-00000010\): a new job "):
        submit(TINY, overrides, SubmitOptions(nodes=1), dry_run=True, out=open(os.devnull, "w"))
    assert sorted(os.listdir(tmp_path / "runs" / "tiny")) == ["checkpoints"]  # no run folder made
    for resume in ("latest", str(step.parent), str(step)):  # a folder of checkpoints: its latest (found by review)
        assert submit(TINY, overrides, SubmitOptions(nodes=1, resume=resume), dry_run=True,
                      out=open(os.devnull, "w"))[0] is None
    assert submit(TINY, [*overrides, f"checkpoint.resume={step.parent}"], SubmitOptions(nodes=1), dry_run=True,
                  out=open(os.devnull, "w"))[0] is None


def test_dry_run_writes_the_script_into_a_new_run_folder(tmp_path):
    env = {**os.environ, "PATH": os.path.dirname(sys.executable)}  # no sbatch needed
    out = zerorun("submit", TINY, "zero.stage=1", f"log.dir={tmp_path}/runs", "--nodes", "2", "--dry-run", "--",
                  "--qos=low", env=env, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    (run,) = (tmp_path / "runs" / "tiny").iterdir()
    written = (run / "submit.sbatch").read_text()
    assert out.stdout.startswith(written) and "#SBATCH --qos=low\n" in written
    assert f"sbatch {shlex.quote(str(run / 'submit.sbatch'))}" in out.stdout.splitlines()[-1]
    assert "stage: 1" in (run / "recipe.yaml").read_text()  # the resolved recipe, before the job runs
    assert not (run / "slurm-job.json").exists()


def test_resume_goes_to_the_jobs_train(tmp_path):
    """``zerorun submit --resume`` makes the job's zerorun train resume (the latest checkpoint, or a given one
    as an absolute path), so the same script submitted again or requeued continues (without it, a requeued run
    does); a missing path is one line."""
    def train_line(*args):
        out = zerorun("submit", TINY, f"log.dir={tmp_path}/runs", "--dry-run", *args, cwd=str(tmp_path))
        assert out.returncode == 0, out.stderr
        return next(line for line in out.stdout.splitlines() if "--run-dir" in line)

    assert "--no-dashboard --resume --run-dir" in train_line("--resume")
    (tmp_path / "ck" / "step-1").mkdir(parents=True)
    assert f"--resume={tmp_path}/ck/step-1 --run-dir" in train_line("--resume", "ck/step-1")
    assert ' --run-dir "$RUN_DIR" ${SLURM_RESTART_COUNT:+--resume}' in train_line()  # only when requeued
    assert "--resume" not in train_line("runtime=ddp")  # a baseline saves no checkpoints (found by review: exit 2)
    out = zerorun("submit", TINY, "--dry-run", "--resume", "nope/step-3", cwd=str(tmp_path))
    assert out.returncode == 2 and out.stderr == "zerorun: error: --resume nope/step-3: no such checkpoint\n"


def untold_recipe():
    """tiny.yaml as if it had no ``launch: {procs_per_node: 2}``: a recipe that leaves the ranks untold."""
    recipe = load_recipe(TINY, [], check_optimizer=False)
    return recipe.model_copy(update={"launch": type(recipe.launch)()})


def ranks(text: str) -> tuple[str, str]:
    """(``--ntasks-per-node`` of the script, ``--num-procs`` of its zerorun train)."""
    [tasks] = [d for d in directives(text) if d.startswith("--ntasks-per-node=")]
    line = next(line for line in text.splitlines() if "--launcher slurm --num-procs" in line).split()
    return tasks.split("=")[1], line[line.index("--num-procs") + 1]


def test_gpus_per_node_start_one_rank_per_gpu(tmp_path):
    """Issue 34 item 12: `-- --gpus-per-node=8` wrote --ntasks-per-node=2 and --num-procs 2 (2 ranks on 8 GPUs,
    silently). GPUs asked for (zerorun's --gpus-per-node, sbatch's --gpus-per-node or --gres) give one rank per
    GPU in both places; --procs-per-node may ask for fewer, never more; counts that disagree are one line."""
    untold = untold_recipe()
    assert "procs_per_node" not in untold.launch.model_fields_set

    def render(recipe=untold, **options):
        loaded = load_recipe(TINY, [], check_optimizer=False) if recipe == TINY else recipe
        return render_script(recipe=loaded, recipe_path=TINY, overrides=[], options=SubmitOptions(**options),
                             run_dir=str(tmp_path / "run"), workdir=str(tmp_path), python=sys.executable)

    for args in (("--gpus-per-node=8",), ("--gpus-per-node", "a100:8"), ("--gres=gpu:8",), ("--gres", "gpu:a100:8"),
                 ("--gres=nvme:1,gpu:a100:4,gpu:v100:4",), ("--gres=gpu:8", "--gpus-per-node=8")):
        assert ranks(render(sbatch_args=args)) == ("8", "8"), args
    text = render(gpus_per_node=4)
    assert ranks(text) == ("4", "4") and "--gpus-per-node=4" in directives(text)
    assert ranks(render(gpus_per_node=4, procs_per_node=2)) == ("2", "2")  # explicit: fewer ranks than GPUs
    assert ranks(render(sbatch_args=("--gres=gpu",))) == ("1", "1")
    assert ranks(render()) == ("1", "1")  # no GPUs: the recipe's (default 1)
    assert ranks(render(TINY)) == ("2", "2")
    for options, message in (
            ({"gpus_per_node": 4, "procs_per_node": 8}, "--procs-per-node 8: more ranks than the 4 GPUs per node"),
            ({"gpus_per_node": 4, "sbatch_args": ("--gpus-per-node=8",)},
             "--gpus-per-node 4 and sbatch --gpus-per-node=8: two different GPU counts per node"),
            ({"sbatch_args": ("--gres=gpu:4", "--gpus-per-node=8")}, "two different GPU counts"),
            ({"sbatch_args": ("--gres=gpu:a:b:c",)}, "expected gpu:N or gpu:TYPE:N"),
            ({"sbatch_args": ("--gpus-per-node=many",)}, "expected a GPU count")):
        with pytest.raises(ZerorunError, match=re.escape(message)):
            render(**options)
    with pytest.raises(ZerorunError, match=re.escape("launch.procs_per_node is 2 but the job asks for 8 GPUs per "
                                                     "node: give --procs-per-node 2")):
        render(TINY, sbatch_args=("--gpus-per-node=8",))  # the recipe says 2: which one is meant?
    # a review: for a recipe's 2 ranks on 1 GPU it suggested --procs-per-node 2, which is then refused
    with pytest.raises(ZerorunError) as e:
        render(TINY, gpus_per_node=1)
    assert str(e.value) == ("launch.procs_per_node is 2 but the job asks for 1 GPU per node: give --gpus-per-node 2 "
                            "for 2 ranks per node, or launch.procs_per_node=1 for one rank per GPU")


def test_job_arrays_are_refused(tmp_path):
    """Issue 34 item 13: a job array's tasks trained into one run folder and one checkpoint folder at once.
    zerorun submit refuses --array/-a in one line (no run folder made); the script itself, given to
    `sbatch --array`, refuses to run as an array task."""
    env = {**os.environ, "PATH": os.path.dirname(sys.executable)}
    for args in (["--array=0-1"], ["--array", "0-3%2"], ["-a", "1,2"], ["-a1-2"]):
        out = zerorun("submit", TINY, f"log.dir={tmp_path}/runs", "--dry-run", "--", *args, env=env,
                      cwd=str(tmp_path))
        assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
        assert out.stderr.startswith("zerorun: error: sbatch -") and "job array" in out.stderr
        assert not (tmp_path / "runs").exists()
    for args in (["--nodes=5"], ["-N", "5"]):  # a review: the job ran on 5 nodes, "submitted ... on 1 node"
        out = zerorun("submit", TINY, f"log.dir={tmp_path}/runs", "--dry-run", "--", *args, env=env,
                      cwd=str(tmp_path))
        assert out.returncode == 2 and out.stderr.splitlines() == [
            f"zerorun: error: sbatch {args[0].split('=')[0]} 5: give zerorun submit's --nodes instead (the ranks it "
            "starts and the job's own lines follow it)"], out.stderr
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho ran\n")
    fake.chmod(0o755)
    recipe = load_recipe(TINY, [], check_optimizer=False)
    path = tmp_path / "submit.sbatch"
    path.write_text(render_script(recipe=recipe, recipe_path=TINY, overrides=[], options=SubmitOptions(),
                                  run_dir=str(tmp_path / "run"), workdir=str(tmp_path), python=str(fake)))
    out = subprocess.run(["bash", str(path)], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "SLURM_ARRAY_TASK_ID": "1"})
    assert out.returncode == 2 and out.stdout == "" and "not a job array (task 1)" in out.stderr
    out = subprocess.run(["bash", str(path)], capture_output=True, text=True, timeout=30,
                         env={k: v for k, v in os.environ.items() if k != "SLURM_ARRAY_TASK_ID"})
    assert out.returncode == 0 and out.stdout == "ran\n"


def test_requeued_output_appends_and_the_stop_names_the_resubmit(tmp_path):
    """Issue 34 item 14: a requeued job's slurm-%j.out lost the first attempt's lines (no --open-mode=append);
    the stop message said "continue with zerorun train ... --resume" in a submitted job. The script appends,
    and tells its zerorun train (ZERORUN_CONTINUE) the command that continues it: the script itself with
    --resume, else the submit command again with --resume."""
    from zerorun.slurm.submit import resubmit_command

    text = script(tmp_path, resume="latest")
    assert "--open-mode=append" in directives(text)
    assert f"export ZERORUN_CONTINUE={shlex.quote('sbatch ' + str(tmp_path / 'run' / 'submit.sbatch'))}" in text
    text = script(tmp_path)
    assert "export ZERORUN_CONTINUE='zerorun submit " in text and "--resume'" in text
    assert resubmit_command(["zerorun", "submit", "r.yaml", "a=1", "--dry-run", "-N", "2", "--", "--qos=x"]) == (
        "zerorun submit r.yaml a=1 -N 2 --resume -- --qos=x")


def test_early_save_signal_and_time_limits(tmp_path):
    """Issue 34 item 15: only the time limit's SIGTERM triggered the save, within KillWait (30 s). A recipe
    that saves checkpoints asks SLURM for SIGUSR1 to the batch shell --save-before seconds earlier; none
    without checkpoint.dir or with --save-before 0; a time limit within that is one line."""
    from zerorun.slurm.sbatch import time_limit_s

    ck = [f"checkpoint.dir={tmp_path}/ck"]
    assert "--signal=B:USR1@120" in directives(script(tmp_path, ck))
    assert "--signal=B:USR1@300" in directives(script(tmp_path, ck, save_before=300, time="1-00:00:00"))
    assert not any(d.startswith("--signal") for d in directives(script(tmp_path, ck, save_before=0)))
    assert not any(d.startswith("--signal") for d in directives(script(tmp_path)))  # nothing to save
    with pytest.raises(ZerorunError, match=r"--time 00:02:00: not longer than --save-before 120 s"):
        script(tmp_path, ck, time="00:02:00")
    assert [time_limit_s(t) for t in ("30", "30:15", "01:00:00", "2-3", "2-03:04", "1-00:00:01", "UNLIMITED")] == [
        1800, 1815, 3600, 2 * 86400 + 3 * 3600, 2 * 86400 + 3 * 3600 + 240, 86401, None]
    with pytest.raises(ZerorunError, match="--time 1h: expected minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS "
                                           "or UNLIMITED$"):
        time_limit_s("1h")
    # a review: SLURM reads 0 as no limit, which was refused with checkpoints ("the save signal would come at once")
    assert [time_limit_s(t) for t in ("0", "0:0", "0-0")] == [None] * 3
    assert "--time=0" in directives(script(tmp_path, ck, time="0"))


def test_a_misplaced_sbatch_option_and_a_refused_submit(tmp_path):
    """Issue 34 item 15: `--qos high` before `--` was "No such option: --qos"; it is told where it goes. A
    submit that sbatch refuses leaves no run folder (nothing was queued)."""
    out = zerorun("submit", TINY, "--qos", "high", "--dry-run", cwd=str(tmp_path))
    assert out.returncode == 2 and out.stderr == (
        "zerorun: error: --qos: not an option of zerorun submit; an sbatch option goes after '--', at the end: "
        "zerorun submit RECIPE [FIELD=VALUE ...] [options] -- --qos high\n")
    out = zerorun("submit", TINY, "--dry-run", "--constraint=volta", cwd=str(tmp_path))
    assert out.returncode == 2 and out.stderr.endswith("-- --constraint=volta\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho 'sbatch: error: Batch job submission failed: Invalid qos "
                                    "specification' >&2\nexit 1\n")
    (bin_dir / "sbatch").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.path.dirname(sys.executable)}"}
    (tmp_path / "runs").mkdir()
    out = zerorun("submit", TINY, f"log.dir={tmp_path}/runs", "--", "--qos=nope", env=env, cwd=str(tmp_path))
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
    assert out.stderr.startswith("zerorun: error: sbatch refused the job: Batch job submission failed: Invalid qos")
    assert os.listdir(tmp_path / "runs") == []  # no run folder, no empty runs/tiny left; runs/ was there before


def test_split_sbatch_args():
    from zerorun.cli import split_sbatch_args

    assert split_sbatch_args(["submit", "r.yaml", "a=1", "--", "--qos=x", "a=2"]) == (
        ["submit", "r.yaml", "a=1"], ["--qos=x", "a=2"])
    assert split_sbatch_args(["launch", "s.py", "--", "x"]) == (["launch", "s.py", "--", "x"], [])


def test_estimate_for_nodes_equals_the_same_hostfile(capsys, monkeypatch, tmp_path):
    """``zerorun estimate --nodes 2 --procs-per-node 8`` (the layout of ``zerorun submit --nodes 2
    --procs-per-node 8``) gives the numbers of a hostfile of two hosts with 8 slots each."""
    from zerorun import cli

    hostfile = tmp_path / "hosts"
    hostfile.write_text("node01 slots=8\nnode02 slots=8\n")
    common = ["--params", "350M", "--device-memory", "80GiB", "--cpu-memory", "1TiB", "--json"]  # no torch
    results = []
    for args in (["--nodes", "2", "--procs-per-node", "8"], ["-H", str(hostfile)]):
        monkeypatch.setattr("sys.argv", ["zerorun", "estimate", *args, *common])
        cli.main()
        results.append(json.loads(capsys.readouterr().out))
    assert results[0] == results[1]
    assert results[0]["setup"]["world_size"] == 16 and results[0]["setup"]["nodes"] == 2


def test_the_partition_checked_is_the_one_sbatch_takes(tmp_path, monkeypatch):
    """A review: a job asking for more nodes than its partition has is refused (it pended for ever); the first fix
    checked the first -p where sbatch takes the last, and ignored $SBATCH_PARTITION, which sbatch reads before the
    script's #SBATCH lines. A fake scontrol: 'small' (1 node, the default) and 'big' (4 nodes)."""
    from zerorun.slurm.sbatch import check_partition_size
    from zerorun.slurm.submit import group_args

    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\n"
                    'small="PartitionName=small AllowGroups=ALL Default=YES TotalNodes=1 State=UP"\n'
                    'big="PartitionName=big AllowGroups=ALL Default=NO TotalNodes=4 State=UP"\n'
                    'case "$4" in small) echo "$small";; big) echo "$big";; "") echo "$small"; echo "$big";; '
                    '*) echo "Partition $4 not found"; exit 1;; esac\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("SBATCH_PARTITION", raising=False)
    refused = "--nodes 2: partition small has 1 node, so the job could never start"
    with pytest.raises(ZerorunError, match=refused):
        check_partition_size(2, [])  # the default partition
    with pytest.raises(ZerorunError, match=refused):
        check_partition_size(2, group_args(["-p", "big", "-p", "small"]))
    check_partition_size(2, group_args(["-p", "small", "-p", "big"]))  # the last -p is sbatch's
    check_partition_size(2, [], "big")
    check_partition_size(2, [], "nosuch")  # sbatch's own refusal says it
    check_partition_size(2, group_args(["--partition=small,big"]))  # several: not checked
    monkeypatch.setenv("SBATCH_PARTITION", "big")  # before the script's #SBATCH lines
    check_partition_size(2, group_args(["-p", "small"]), "small")
    with pytest.raises(ZerorunError, match=r"--nodes 5: partition big has 4 nodes"):
        check_partition_size(5, [])
