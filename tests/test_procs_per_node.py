"""Ranks per node (issue 33 item 8, Note [Ranks per node] in zerorun/launch/slots.py): ``launch.procs_per_node:
auto`` by default (one rank per visible GPU, else 1), ``--nproc-per-node gpu|cpu|auto|N`` as torchrun takes it,
every consumer (the plan and its dry run, a SLURM allocation, zerorun submit, estimate), the ``host:0,1`` include
form on this machine, and ``zerorun env``'s GPU lines. Fast: no rank is started; GPUs are faked by replacing the
NVML count (``slots.nvml_gpus``), everything above it is the real code."""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import subprocess
import sys

import pytest

from zerorun.errors import ZerorunError
from zerorun.recipe.hostfile import Host, parse_procs
from zerorun.launch import slots

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "recipes/tiny.yaml")


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n)``: this machine's NVML finds ``n`` GPUs; ``CUDA_VISIBLE_DEVICES`` unset unless a test sets it.
    The dry run's model check (a child importing torch, seconds) finds nothing: the launch is what is tested."""
    from types import SimpleNamespace

    from zerorun.rank import modelcheck

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(modelcheck, "start", lambda *a, **k: SimpleNamespace(wait=lambda: None))

    def fake(n: int) -> None:
        monkeypatch.setattr(slots, "nvml_gpus", lambda: n)
    return fake


@pytest.mark.parametrize("value,expected", [("1", 1), ("8", 8), (" 4 ", 4), (3, 3), ("4096", 4096), ("gpu", "gpu"),
                                            ("CPU", "cpu"), ("auto", "auto")])
def test_parse_procs_takes_torchruns_values(value, expected):
    assert parse_procs(value, "--nproc-per-node") == expected


@pytest.mark.parametrize("value", ["0", "-1", "4097", "x", "1.5", "", "gpus", "٣", "9" * 5000, True])
def test_parse_procs_refuses_the_rest_naming_the_flag(value):
    with pytest.raises(ValueError, match=r"^--nproc-per-node .*: expected ranks per node from 1 to 4096, or gpu"):
        parse_procs(value, "--nproc-per-node")


@pytest.mark.parametrize("spec,present,expected", [
    (None, 8, 8), (None, 0, 0), ("", 8, 0), ("0,1", 8, 2), ("4,5,6", 8, 3), ("1,9,2", 8, 1), ("-1", 8, 0),
    ("0,0", 8, 0), ("2,x,3", 8, 1), ("GPU-aa,GPU-bb", 8, 2), ("GPU-aa,GPU-bb", 1, 1), ("0,1", 0, 0),
])
def test_visible_gpus_read_cuda_visible_devices_as_cuda_does(spec, present, expected):
    environ = {} if spec is None else {"CUDA_VISIBLE_DEVICES": spec}
    assert slots.visible_gpus(environ, physical=lambda: present) == expected


def test_nvml_counts_what_torch_counts(monkeypatch):
    """The launcher's torch-free count is torch's (0 without an NVIDIA driver, as on the CPU test machine)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    import torch

    assert slots.visible_gpus() == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_words_on_this_machine(gpus):
    gpus(0)
    assert [slots.resolve(v, "x") for v in (3, "auto", "cpu")] == [3, 1, slots.cpus()]
    with pytest.raises(ZerorunError, match=r"^--nproc-per-node gpu: no GPU visible on this machine; give a number"):
        slots.resolve("gpu", "--nproc-per-node")
    gpus(8)
    assert [slots.resolve(v, "x") for v in ("auto", "gpu")] == [8, 8]
    os.environ["CUDA_VISIBLE_DEVICES"] = "6,7"  # undone by the fixture's monkeypatch
    assert [slots.resolve(v, "x") for v in ("auto", "gpu", 1)] == [2, 2, 1]
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    with pytest.raises(ZerorunError, match=r"gpu: no GPU visible on this machine \(CUDA_VISIBLE_DEVICES=''\)"):
        slots.resolve("gpu", "launch.procs_per_node")


def dry_run(*args: str) -> tuple[str, str, list[list[str]]]:
    """``zerorun ARGS --dry-run`` in this process (the faked GPU count applies): stdout, stderr, commands."""
    from zerorun import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        cli.app(args=[args[0], "--dry-run", *args[1:]], standalone_mode=False)
    lines = [shlex.split(x) for x in out.getvalue().splitlines() if x and not x.startswith("#")]
    return out.getvalue(), err.getvalue(), lines


def nproc(cmd: list[str]) -> int:
    return int(next(a for a in cmd if a.startswith("--nproc-per-node=")).split("=")[1])


def test_the_default_is_auto_and_the_dry_run_shows_its_count(gpus):
    """The recipe's default: 1 rank on a machine without GPUs (as before), one per visible GPU with them (was 1
    on 8 GPUs); --nproc-per-node's words and numbers override it; the dry run prints the count that runs."""
    from zerorun.recipe import load_recipe

    assert load_recipe(TINY, ["launch.procs_per_node=auto"], check_optimizer=False).launch.procs_per_node == "auto"
    gpus(0)
    _, err, [cmd] = dry_run("train", TINY, "launch.procs_per_node=auto")
    assert nproc(cmd) == 1 and err == ""  # nothing said: the old default
    gpus(8)
    _, err, [cmd] = dry_run("train", TINY, "launch.procs_per_node=auto")
    assert nproc(cmd) == 8 and "CUDA_VISIBLE_DEVICES" not in " ".join(cmd)
    assert err == "zerorun: launch.procs_per_node auto: 8 ranks on this machine, one per visible GPU\n"
    os.environ["CUDA_VISIBLE_DEVICES"] = "4,5,6"
    for args, expected in ((["launch.procs_per_node=auto"], 3), (["--nproc-per-node", "gpu"], 3),
                           (["--nproc_per_node=2"], 2), (["--num-procs", "cpu"], slots.cpus()),
                           (["launch.procs_per_node=gpu", "--nproc-per-node", "auto"], 3)):
        _, _, [cmd] = dry_run("train", TINY, *args)
        assert nproc(cmd) == expected, args
    _, _, [cmd] = dry_run("launch", "--nproc-per-node", "gpu", TINY)  # zerorun launch: the same flag
    assert nproc(cmd) == 3
    # the ranks' own CUDA_VISIBLE_DEVICES (launch.env) is what they see, not the launcher's
    _, _, [cmd] = dry_run("train", TINY, "launch.procs_per_node=auto", "launch.env.CUDA_VISIBLE_DEVICES=1,2")
    assert nproc(cmd) == 2


def test_include_selects_this_machines_gpus_by_place(gpus, tmp_path):
    """DeepSpeed's ``host:0,1``: without a hostfile the slots are this machine's visible GPUs (``localhost:1``
    was 'unknown slot 1': one slot); the ranks get CUDA_VISIBLE_DEVICES of those GPUs, through the launcher's
    own CUDA_VISIBLE_DEVICES (its slot 0 is its first visible GPU); a hostfile's slots are device indices."""
    gpus(8)
    auto = "launch.procs_per_node=auto"  # tiny.yaml says 2
    _, _, [cmd] = dry_run("train", TINY, auto, "--include", "localhost:1,3")
    assert nproc(cmd) == 2 and "CUDA_VISIBLE_DEVICES=1,3" in cmd
    os.environ["CUDA_VISIBLE_DEVICES"] = "4,5,6,7"
    _, _, [cmd] = dry_run("train", TINY, auto, "--include", "localhost:0,2")
    assert nproc(cmd) == 2 and "CUDA_VISIBLE_DEVICES=4,6" in cmd
    # the ranks' own list (launch.env) is the one counted and selected from, and the value zerorun sets over it
    # is printed (launch.env's values are printed by name only: it was CUDA_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES")
    _, _, [cmd] = dry_run("train", TINY, auto, "launch.env.CUDA_VISIBLE_DEVICES=1,2,3", "--include", "localhost:2")
    assert nproc(cmd) == 1 and "CUDA_VISIBLE_DEVICES=3" in cmd
    (tmp_path / "hosts").write_text("localhost slots=4\n")
    _, _, [cmd] = dry_run("train", TINY, "-H", str(tmp_path / "hosts"), "--include", "localhost:0,2")
    assert nproc(cmd) == 2 and "CUDA_VISIBLE_DEVICES=0,2" in cmd
    for word, expected in (("auto", 4), ("gpu", 4), ("3", 3)):  # with a hostfile: its slots, at most
        _, _, [cmd] = dry_run("train", TINY, "-H", str(tmp_path / "hosts"), "--nproc-per-node", word)
        assert nproc(cmd) == expected, word
    with pytest.raises(ZerorunError, match=r"^--nproc-per-node cpu: with a hostfile each host runs its slots="):
        dry_run("train", TINY, "-H", str(tmp_path / "hosts"), "--nproc-per-node", "cpu")


@pytest.mark.parametrize("args,expected", [
    (["train", TINY, "--nproc-per-node", "0"], r"Invalid value for '--nproc-per-node'.*'0': expected ranks per node "
                                               r"from 1 to 4096, or gpu"),
    (["launch", "--nproc-per-node", "gpus", "s.py"], r"Invalid value for '--nproc-per-node'.*'gpus': expected"),
    (["train", TINY, "launch.procs_per_node=many"], r"override 'launch\.procs_per_node=many': launch\.procs_per_node: "
                                                    r"expected ranks per node from 1 to 4096, or gpu .*; got 'many'$"),
    (["train", TINY, "--nproc-per-node", "gpu"], r"^zerorun: error: --nproc-per-node gpu: no GPU visible"),
    # a number of ranks that --include/--exclude cut short (was: 2 ranks started, silently; DeepSpeed refuses both)
    (["train", TINY, "--include", "localhost:0,1", "--nproc-per-node", "4"], r"^zerorun: error: --nproc-per-node 4 "
     r"and --include localhost:0,1: 2 of localhost's 4 slots selected; give the ranks by one of them$"),
    (["launch", "--exclude", "localhost:3", "--num-procs", "4", "s.py"], r"^zerorun: error: --num-procs 4 "
     r"and --exclude localhost:3: 3 of localhost's 4 slots selected"),  # the option's name as typed
    (["launch", "--nnodes", "3", "s.py"], r"^zerorun: error: --nnodes 3: only 1 host\(s\) selected$"),
])
def test_bad_counts_are_one_line_naming_the_flag_or_field(args, expected, tmp_path):
    import re

    (tmp_path / "s.py").write_text("")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, on a GPU machine too
    out = subprocess.run([sys.executable, "-m", "zerorun", args[0], "--dry-run", *args[1:]], cwd=str(tmp_path), env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and re.search(expected, out.stderr.strip()), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


def test_a_slurm_allocation_counts_words_by_its_own_resources():
    from zerorun.launch.slurm import slots_per_node

    assert slots_per_node({}, "auto") == ([1], "launch.procs_per_node auto")
    assert slots_per_node({"SLURM_GPUS_ON_NODE": "4"}, "auto", None, 2) == ([4, 4], "the allocation's GPUs per node")
    assert slots_per_node({"SLURM_GPUS_ON_NODE": "4"}, 1, "gpu")[0] == [4]
    assert slots_per_node({"SLURM_GPUS_ON_NODE": "4"}, 1, "auto")[0] == [4]
    assert slots_per_node({"SLURM_JOB_CPUS_PER_NODE": "8,4"}, "cpu", None, 2)[0] == [8, 4]
    assert slots_per_node({"SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "2"}, "auto") == (
        [2], "SLURM_TASKS_PER_NODE=2")  # the tasks: no note about an 'auto' recipe
    with pytest.raises(ZerorunError, match=r"^--num-procs gpu: the SLURM allocation has no GPU"):
        slots_per_node({}, 1, "gpu")
    with pytest.raises(ZerorunError, match=r"^launch.procs_per_node cpu: the allocation's CPUs per node are not"):
        slots_per_node({}, "cpu")


def test_a_submitted_job_counts_auto_from_the_gpus_it_asks_for():
    from zerorun.slurm.sbatch import ranks_per_node
    from zerorun.recipe import load_recipe

    auto = load_recipe(TINY, ["launch.procs_per_node=auto"], check_optimizer=False)
    assert ranks_per_node(None, 8, auto) == (8, "one rank per GPU")
    assert ranks_per_node(None, None, auto) == (1, "launch.procs_per_node auto, no GPU asked for")
    assert ranks_per_node(2, None, load_recipe(TINY, ["launch.procs_per_node=cpu"], check_optimizer=False))[0] == 2
    gpu = load_recipe(TINY, ["launch.procs_per_node=gpu"], check_optimizer=False)
    assert ranks_per_node(None, 4, gpu)[0] == 4
    with pytest.raises(ZerorunError, match=r"^launch.procs_per_node gpu: the job asks for no GPU: give --gpus-per"):
        ranks_per_node(None, None, gpu)
    with pytest.raises(ZerorunError, match=r"^launch.procs_per_node cpu: a batch job's ranks per node are needed"):
        ranks_per_node(None, None, load_recipe(TINY, ["launch.procs_per_node=cpu"], check_optimizer=False))


def test_estimate_says_what_it_assumed_for_a_word(gpus, capsys):
    from zerorun.estimate import from_arguments

    gpus(4)
    args = dict(recipe=TINY, hostfile=None, params=None, largest_layer=None, nodes=None, procs_per_node=None,
                precision=None, optimizer=None, device_memory="80GiB", cpu_memory=None, bandwidth="100Gbps",
                micro_batch=None)
    result = from_arguments(overrides=["launch.procs_per_node=auto"], **args)
    assert result.to_json()["setup"]["procs_per_node"] == 4
    assert capsys.readouterr().err == ("zerorun: estimate: launch.procs_per_node auto: assumed 4 per node (4 "
                                       "visible GPUs on this machine); give --procs-per-node N for another count\n")
    assert from_arguments(overrides=["launch.procs_per_node=2"], **args).to_json()["setup"]["procs_per_node"] == 2
    assert capsys.readouterr().err == ""


def test_env_names_the_gpus(gpus):
    from zerorun.cli.env import auto_line, cuda_devices, gpu_text, report

    assert gpu_text([["NVIDIA H200", 150754820096]] * 8) == "8: NVIDIA H200, 140.4 GiB x 8"
    assert gpu_text([["A", 2**34], ["B", 2**35]]) == "2: A, 16.0 GiB; B, 32.0 GiB"
    assert gpu_text([]) == "no GPU (CUDA not available)"
    assert gpu_text("cannot import torch: X") == "unknown (cannot import torch: X)"
    rows = dict(line.split("  ", 1) for line in report().splitlines())
    assert rows["GPUs"].strip() == gpu_text(cuda_devices())  # this machine's: no GPU (CUDA not available)
    gpus(8)
    assert auto_line({"CUDA_VISIBLE_DEVICES": "0,1"}) == ("procs_per_node auto", "2 ranks (2 of the 8 GPUs NVML "
                                                                                 "finds, CUDA_VISIBLE_DEVICES=0,1)")


def test_a_hostfile_host_keeps_its_slots():
    """A hostfile's ``slots=`` stay numbers (the count the dry run prints for a host it does not contact)."""
    from zerorun.recipe.hostfile import parse_hostfile

    assert parse_hostfile("a slots=8\n") == [Host("a", 8)]
    with pytest.raises(ZerorunError, match=r"^hostfile:1: a: slots must be a positive integer, got 'auto'$"):
        parse_hostfile("a slots=auto\n")


def test_a_recipes_procs_per_node_beside_a_hostfile_is_said_to_give_way(gpus, tmp_path):
    """DeepSpeed's rule: with a hostfile each host runs its slots= ranks; a recipe's launch.procs_per_node that
    differs is said so in one line (found by review: silently ignored), not where the slots agree or
    --num-procs decides."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=1\n")
    _, err, _ = dry_run("train", TINY, "-H", str(hosts))  # tiny.yaml sets launch.procs_per_node: 2
    assert err == (f"zerorun: launch.procs_per_node 2 is for runs without a hostfile: each host of "
                                   f"{hosts} runs its slots= ranks (localhost 1); --num-procs N runs N on each\n")
    for args in (["launch.procs_per_node=1"], ["--num-procs", "1"]):
        _, err, _ = dry_run("train", TINY, "-H", str(hosts), *args)
        assert err == "", args
