"""The SLURM launcher's pure parts (launch/slurm.py): which launcher, the allocation's nodes and slots, the srun
command; and the dry-run and run folder texts. The real cluster runs are in tests/test_slurm_launch.py."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest

from zerorun.errors import ZerorunError
from zerorun.recipe.hostfile import Host
from zerorun.launch import slurm
from zerorun.launch.commands import render_slurm
from zerorun.launch.launcher import Launcher, choose_launcher
from zerorun.launch.nodes import Ended, Line
from zerorun.launch.plan import build_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_choose_launcher_default_and_explicit():
    inside = {"SLURM_JOB_ID": "12"}
    assert choose_launcher(None, None, inside) is Launcher.SLURM
    assert choose_launcher(None, "hosts", inside) is Launcher.SSH  # -H inside an allocation: today's behaviour
    assert choose_launcher(None, None, {}) is Launcher.SSH
    assert choose_launcher("local", None, inside) is Launcher.LOCAL
    assert choose_launcher("ssh", None, inside) is Launcher.SSH
    with pytest.raises(ZerorunError, match="not inside a SLURM allocation"):
        choose_launcher("slurm", None, {})
    with pytest.raises(ZerorunError, match="--launcher slurm takes its hosts from the SLURM allocation"):
        choose_launcher("slurm", "hosts", inside)
    with pytest.raises(ZerorunError, match="--launcher local runs on this machine alone"):
        choose_launcher("local", "hosts", {})
    with pytest.raises(ZerorunError, match="--launcher pbs: expected one of ssh, slurm, local"):
        choose_launcher("pbs", None, {})


def test_zerorun_under_srun_is_a_one_line_error():
    """`srun zerorun train` (SLURM_STEP_ID set): its own srun step would wait for the CPUs the enclosing step
    holds, silently, for ever (review); --launcher local still runs one machine's job per task."""
    step = {"SLURM_JOB_ID": "12", "SLURM_STEP_ID": "0"}
    for launcher in (None, "slurm"):
        with pytest.raises(ZerorunError, match=r"started inside a SLURM job step \(SLURM_STEP_ID=0: under srun\)"):
            choose_launcher(launcher, None, step)
    assert choose_launcher("local", None, step) is Launcher.LOCAL
    assert choose_launcher(None, "hosts", step) is Launcher.SSH
    # SLURM's own steps are not srun's: the shell of salloc under LaunchParameters=use_interactive_step
    # (SLURM_STEP_ID=4294967290; review: refused, though srun works from it) and the batch script
    for special in ("4294967290", "4294967291"):
        assert choose_launcher(None, None, {"SLURM_JOB_ID": "12", "SLURM_STEP_ID": special}) is Launcher.SLURM
    env = dict(os.environ, **step)
    out = subprocess.run([sys.executable, "-m", "zerorun", "train", os.path.join(ROOT, "recipes/tiny.yaml"),
                          "--dry-run"], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "SLURM_STEP_ID=0" in out.stderr, out.stderr


def test_expand_counts():
    assert slurm.expand_counts("72(x2),36") == [72, 72, 36]
    assert slurm.expand_counts("2") == [2]
    with pytest.raises(ZerorunError, match=r"SLURM_JOB_CPUS_PER_NODE='2\(x\)': expected counts"):
        slurm.expand_counts("2(x)")


def test_slots_order():
    """--num-procs, then GPUs per node, then the allocation's tasks, then the recipe's launch.procs_per_node."""
    env = {"SLURM_GPUS_ON_NODE": "4", "SLURM_NTASKS_PER_NODE": "2"}
    assert slurm.slots_per_node(env, 3, 5) == ([5], "--num-procs")
    assert slurm.slots_per_node(env, 3, count=2) == ([4, 4], "the allocation's GPUs per node")
    assert slurm.slots_per_node({"SLURM_GPUS_PER_NODE": "a100:2,v100:1", "SLURM_NTASKS_PER_NODE": "1"}, 3) == (
        [3], "the allocation's GPUs per node")
    assert slurm.slots_per_node({"SLURM_GPUS_PER_NODE": "8"}, 1)[0] == [8]
    assert slurm.slots_per_node({"SLURM_NTASKS_PER_NODE": "2"}, 2) == ([2], "SLURM_NTASKS_PER_NODE")
    assert slurm.slots_per_node({}, 3) == ([3], "launch.procs_per_node")
    with pytest.raises(ZerorunError, match="SLURM_NTASKS_PER_NODE='two': expected a positive number"):
        slurm.slots_per_node({"SLURM_NTASKS_PER_NODE": "two"}, 1)
    with pytest.raises(ZerorunError, match="SLURM_GPUS_PER_NODE='a100:'"):
        slurm.slots_per_node({"SLURM_GPUS_PER_NODE": "a100:"}, 1)


#: what salloc/sbatch set for each allocation (slurm 22.05, 2 nodes of 2 CPUs: tests/slurm_cluster.py)
ALLOCATIONS = {
    "-N2": {"SLURM_JOB_CPUS_PER_NODE": "1(x2)", "SLURM_TASKS_PER_NODE": "1(x2)"},
    "-N2 -n3": {"SLURM_JOB_CPUS_PER_NODE": "2,1", "SLURM_NTASKS": "3", "SLURM_NPROCS": "3",
                "SLURM_TASKS_PER_NODE": "2,1"},
    "-N2 -n4": {"SLURM_JOB_CPUS_PER_NODE": "2(x2)", "SLURM_NTASKS": "4", "SLURM_NPROCS": "4",
                "SLURM_TASKS_PER_NODE": "2(x2)"},
    "-N2 --ntasks-per-node=2": {"SLURM_JOB_CPUS_PER_NODE": "2(x2)", "SLURM_NTASKS": "4",
                                "SLURM_NTASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "2(x2)"},
    "-n1": {"SLURM_JOB_CPUS_PER_NODE": "1", "SLURM_NTASKS": "1", "SLURM_NPROCS": "1", "SLURM_TASKS_PER_NODE": "1"},
    "-N1": {"SLURM_JOB_CPUS_PER_NODE": "1", "SLURM_TASKS_PER_NODE": "1"},
}


def test_the_allocations_tasks_are_the_ranks_as_srun_places_them():
    """Issue 34 item 11: inside an allocation whose tasks were asked for (-n, --ntasks-per-node), the ranks on
    each node are its tasks there, uneven ones included (srun's placement); the recipe's count is used only
    when no task count was given, and refused where it exceeds a node's CPUs; --num-procs and GPUs still win."""
    def slots(allocation, recipe_slots, count, num_procs=None):
        return slurm.slots_per_node(ALLOCATIONS[allocation], recipe_slots, num_procs, count)[0]

    assert slots("-N2 -n3", 1, 2) == [2, 1]  # was 1 per node (or the recipe's 2 per node: 4 ranks)
    assert slots("-N2 -n3", 2, 2) == [2, 1]
    assert slots("-N2 -n4", 1, 2) == [2, 2]  # was 2 ranks
    assert slots("-N2 --ntasks-per-node=2", 1, 2) == [2, 2]
    assert slots("-n1", 4, 1) == [1]  # was the recipe's 4 on one CPU
    assert slots("-N2", 1, 2) == [1, 1]
    assert slots("-N2 -n3", 4, 2, num_procs=1) == [1, 1]  # --num-procs: explicit
    assert slurm.slots_per_node({**ALLOCATIONS["-N2 -n3"], "SLURM_GPUS_ON_NODE": "2"}, 1, None, 2)[0] == [2, 2]
    assert "not the recipe's launch.procs_per_node 1" in slurm.slots_per_node(ALLOCATIONS["-N2 -n4"], 1, None, 2)[1]
    for allocation, recipe_slots in (("-N1", 4), ("-N2", 2)):
        with pytest.raises(ZerorunError, match=rf"launch.procs_per_node {recipe_slots}: more ranks than the 1 CPU "
                                               r"SLURM allocated on a node .*--ntasks-per-node"):
            slots(allocation, recipe_slots, int(allocation[-1]))
    with pytest.raises(ZerorunError, match=r"SLURM_TASKS_PER_NODE='2,1': 2 node counts for the allocation's 3"):
        slots("-N2 -n3", 1, 3)
    assert slurm.describe_slots([Host("a", 2), Host("b", 1)], "X") == "3 ranks: 2, 1 per node (from X)"
    assert slurm.describe_slots([Host("a", 2), Host("b", 2)], "X") == "2 ranks per node (from X)"


def test_allocation_hosts(monkeypatch):
    monkeypatch.setattr(slurm, "expand_nodelist", lambda nodelist: {"n[1-3]": ["n1", "n2", "n3"]}[nodelist])
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_NTASKS_PER_NODE": "2",
           "SLURM_JOB_CPUS_PER_NODE": "8(x2),4"}
    hosts, source = slurm.allocation_hosts(1, environ=env)
    assert hosts == [Host("n1", 2), Host("n2", 2), Host("n3", 2)] and source.startswith("SLURM_NTASKS_PER_NODE")
    assert slurm.allocation_hosts(1, num_nodes=2, num_procs=1, environ=env)[0] == [Host("n1", 1), Host("n2", 1)]
    uneven = {**env, "SLURM_NTASKS": "5", "SLURM_TASKS_PER_NODE": "2(x2),1"}
    assert slurm.allocation_hosts(1, environ=uneven)[0] == [Host("n1", 2), Host("n2", 2), Host("n3", 1)]
    assert slurm.allocation_hosts(1, num_nodes=2, environ=uneven)[0] == [Host("n1", 2), Host("n2", 2)]
    assert slurm.allocation_cpus(env) == {"n1": 8, "n2": 8, "n3": 4}
    with pytest.raises(ZerorunError, match=r"--num-nodes 4: the allocation has 3 nodes \(n\[1-3\]\)"):
        slurm.allocation_hosts(1, num_nodes=4, environ=env)
    with pytest.raises(ZerorunError, match="SLURM_JOB_NODELIST is not"):
        slurm.allocation_hosts(1, environ={"SLURM_JOB_ID": "7"})
    with pytest.raises(ZerorunError, match=r"^--nnodes 1:4: the allocation has 3 nodes"):  # the flag as typed
        slurm.allocation_hosts(1, num_nodes=4, environ=env, nodes_flag="--nnodes 1:4")


def test_ranks_per_node_that_include_cuts_short_in_an_allocation_are_one_line(monkeypatch):
    """``--nproc-per-node 2 --include n1:0`` in an allocation started 1 rank, silently (as on one machine)."""
    from zerorun.launch import Launcher, select

    monkeypatch.setattr(slurm, "expand_nodelist", lambda nodelist: ["n1", "n2"])
    for k, v in {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NTASKS_PER_NODE": "2"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ZerorunError, match=r"^--num-procs 2 and --include n1:0: 1 of n1's 2 slots selected; give the "
                                           r"ranks by one of them$"):
        select(None, 1, include="n1:0", num_procs=2, launcher=Launcher.SLURM, procs_flag="--num-procs 2")
    assert [h.slots for h in select(None, 1, include="n1:0,1", num_procs=2, launcher=Launcher.SLURM)] == [2]


def test_srun_command_for_two_nodes(monkeypatch):
    monkeypatch.setattr(slurm.shutil, "which", lambda name: f"/usr/bin/{name}")
    hosts = [Host("n1", 2), Host("n2", 2)]
    argv = slurm.srun_argv(hosts, "/work dir", "/py/python", job_id="7", cpus={"n1": 8, "n2": 4},
                           job_name="zerorun-abc")
    assert argv == ["/usr/bin/srun", "--jobid=7", "--job-name=zerorun-abc", "--nodes=2", "--ntasks=2",
                    "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--input=all", "--label", "--mpi=none",
                    "--nodelist=n1,n2", "--cpus-per-task=4", "--chdir=/work dir",
                    "/py/python", "-m", "zerorun.launch.slurm_task"]
    assert "--cpus-per-task" not in " ".join(slurm.srun_argv(hosts, "/w", "/py", job_id="7"))
    with_gpus = slurm.srun_argv(hosts, "/w", "/py", job_id="7", gpus=4)
    assert with_gpus[with_gpus.index("--chdir=/w") - 1] == "--gpus-per-node=4"


def test_launcher_flag_errors_are_one_line_exit_2(tmp_path):
    import os
    import subprocess
    import sys

    from test_train_e2e import ROOT, TINY

    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run([sys.executable, "-m", "zerorun", "train", TINY, "--launcher", "slurm", "--dry-run"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr == (
        "zerorun: error: --launcher slurm: not inside a SLURM allocation (SLURM_JOB_ID is not set): run it under "
        "salloc or in an sbatch script\n")


def test_slurm_commands_text_runs_each_node_by_name(monkeypatch):
    """The dry run / commands.sh: the exact srun command as a comment, then one srun line whose task picks its
    node's torchrun command by SLURMD_NODENAME: node rank 0 on the first node, the master address its name;
    launch.env values are never printed."""
    monkeypatch.setattr(slurm.shutil, "which", lambda name: f"/usr/bin/{name}")
    hosts = [Host("n1", 2), Host("n2", 2)]
    plan = build_plan(hosts, "{}", "abc", 29600, "/py", {"TOKEN": "s3cret"}, master_addr="n1")
    srun = slurm.srun_argv(hosts, "/w", "/py", job_id="7")
    text = render_slurm(plan, "/w", {0: "/tmp/d", 1: "/tmp/d"}, {"TOKEN"}, srun)
    assert "s3cret" not in text and 'TOKEN="$TOKEN"' in text
    assert "#   " + slurm.render_srun(srun) in text
    run = text[text.index("\n/usr/bin/srun ") + 1:]
    words = shlex.split(run)
    assert words[:words.index("bash")] == srun[:-3] and words[-3:-1] == ["bash", "-c"]
    script = words[-1]
    assert script.startswith('case "$SLURMD_NODENAME" in\nn1) ') and script.endswith("esac")
    assert "--node-rank=0 --master-addr=n1 --master-port=29600" in script.split("\n")[1]
    assert "--node-rank=1 --master-addr=n1 --master-port=29600" in script.split("\n")[2]


def test_an_srun_that_ends_before_reading_its_input_reports_its_own_error():
    """srun refusing the step exits without reading the nodes' specs on its stdin: the write's broken pipe used
    to stop the launcher with "cannot start srun: Broken pipe" (seen 1 run in 10 in the test below, where cat
    reads no input), hiding srun's line. The specs here exceed a pipe's 64 KiB, so the write must break."""
    import queue

    from zerorun.launch.slurm_step import SlurmNode, SlurmStep

    plan = build_plan([Host(f"node{i:04d}", 1) for i in range(400)], "{}", "abc", 29600, master_addr="node0000")
    lines: queue.Queue = queue.Queue()
    refuse = ["sh", "-c", "exec 0<&-; echo 'srun: error: Unable to create step for job 12: Invalid'; exit 1"]
    step = SlurmStep(refuse, plan.nodes, lines)
    nodes = [SlurmNode(spec, step) for spec in plan.nodes]
    nodes[0].start()  # raised ZerorunError before
    got = [lines.get(timeout=30)]
    assert got[0] == Line(0, "srun: error: Unable to create step for job 12: Invalid"), got
    step.proc.wait(timeout=30)
    for _ in range(300):
        if len(step.ended) == len(nodes):
            break
        __import__("time").sleep(0.1)
    assert all(node.returncode == 1 for node in nodes)


def test_step_output_is_split_by_node_and_long_lines_joined(tmp_path):
    """launch/slurm_step.py reads srun --label output: each task's first line maps it to its node (task 0 may run
    node 1), a line srun cut into 1024-byte pieces is one line again (a rank's error event), a node's end line
    gives its exit code, and a node killed before it could say so is named from srun's report."""
    import json
    import queue

    from zerorun.launch.slurm_step import SlurmNode, SlurmStep
    from zerorun.launch.slurm_task import TASK_PREFIX
    from zerorun.telemetry.events import format_event, parse_line

    plan = build_plan([Host("n1", 1), Host("n2", 1)], "{}", "abc", 29600, master_addr="n1")
    event = format_event("error", 1, type="RuntimeError", message="x" * 3000, peer_failure=False)
    pieces = [event[i:i + 1024] for i in range(0, len(event), 1024)]
    out = [f"0: {TASK_PREFIX}" + json.dumps({"node_rank": 1, "step": "7.0"}),
           f"1: {TASK_PREFIX}" + json.dumps({"node_rank": 0, "step": "7.0"}),
           *[f"0: {p}" for p in pieces], "1: [rank 0] hello",
           f"0: {TASK_PREFIX}" + json.dumps({"node_rank": 1, "exit": 1}),
           "srun: error: n1: task 1: Killed"]
    printer = tmp_path / "out.txt"
    printer.write_text("\n".join(out) + "\n")
    lines: queue.Queue = queue.Queue()
    step = SlurmStep(["cat", str(printer)], plan.nodes, lines)  # stands in for srun: prints its output
    nodes = [SlurmNode(spec, step) for spec in plan.nodes]
    nodes[0].start()
    got = []
    while len([item for item in got if isinstance(item, Ended)]) < 2:
        got.append(lines.get(timeout=10))
    text = [item for item in got if isinstance(item, Line)]
    assert text[0] == Line(1, event) and parse_line(text[0].text).data["message"] == "x" * 3000
    assert text[1] == Line(0, "[rank 0] hello") and text[2] == Line(0, "srun: error: n1: task 1: Killed")
    ended = sorted((e for e in got if isinstance(e, Ended)), key=lambda e: e.node_rank)
    assert ended == [Ended(0, -9, "its srun task on n1: Killed"), Ended(1, 1)]
    assert step.step == "7.0" and nodes[1].returncode == 1 and nodes[1].end_reason is None
    assert nodes[0].returncode == -9 and nodes[0].end_reason == "its srun task on n1: Killed"
