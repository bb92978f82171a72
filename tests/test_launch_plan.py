"""One plan path (Note [One plan path] in launch/job.py): the commands ``--dry-run`` prints are the ones the job
runs, the SSH config's aliases resolved, without an sshd (fabric reads the config without connecting)."""

import contextlib
import io
import os
import shlex

import pytest

from zerorun.recipe.hostfile import Host
from zerorun.launch import job as launch_job
from zerorun.launch.launcher import Launcher
from zerorun.launch.preflight import HostCheck
from zerorun.launch.remote import SshOptions, connection
from zerorun.launch.dryrun import dry_run
from zerorun.launch.run import prepare
from zerorun.launch.script import Script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "recipes/tiny.yaml")


@pytest.fixture
def aliases(tmp_path):
    """An SSH config naming two loopback hosts by alias, and a hostfile naming them so."""
    config = tmp_path / "ssh_config"
    config.write_text("Host zr-h2\n  HostName 127.0.0.2\nHost zr-h3\n  HostName 127.0.0.3\n")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("zr-h2 slots=1\nzr-h3 slots=1\n")
    return str(config), str(hostfile)


def cli_dry_run(*args: str) -> list[list[str]]:
    """``zerorun ARGS --dry-run`` in this process: the commands, each split as a shell would (comments kept
    as one-element lists of their text)."""
    from zerorun import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        cli.app(args=[args[0], "--dry-run", *args[1:]], standalone_mode=False)
    return [[x] if x.startswith("#") else shlex.split(x) for x in out.getvalue().splitlines() if x]


def option(cmd: list[str], name: str) -> str:
    return next(a.split("=", 1)[1] for a in cmd if a.startswith(f"--{name}="))


def test_dry_run_prints_the_aliases_address_not_the_alias(aliases):
    """The bug: with hosts named by SSH aliases the dry run printed ``--master-addr=zr-h2`` (a name only this
    machine's SSH config knows: the other node cannot resolve it) where the job uses the alias's HostName."""
    config, hostfile = aliases
    lines = cli_dry_run("train", TINY, "-H", hostfile, "--ssh-config", config, "--master-port", "29555")
    cmds = [c for c in lines if not c[0].startswith("#")]
    assert len(cmds) == 2
    assert [option(c, "master-addr") for c in cmds] == ["127.0.0.2", "127.0.0.2"]
    assert [option(c, "master-port") for c in cmds] == ["29555", "29555"]
    # without --master-port the job picks a free port on the first host at start: said plainly, not hidden
    lines = cli_dry_run("train", TINY, "-H", hostfile, "--ssh-config", config)
    assert [option(c, "master-port") for c in lines if not c[0].startswith("#")] == ["29500", "29500"]
    assert any("the job picks a free port on zr-h2 when it starts" in c[0] and "--master-port" in c[0]
               for c in lines if c[0].startswith("#"))


def _fake_preflight(port: int):
    """launch/job.py's preflight, answering as the hosts would: unopened connections (the SSH config read),
    ``port`` free on the first host, 4 CPUs each."""
    def preflight(hosts, opts, *, port: int | None = None, **_):
        return [HostCheck(h, connection(h.name, opts), None, {"cpus": 4, "port": port or chosen if i == 0 else None})
                for i, h in enumerate(hosts)]

    chosen = port
    return preflight


@pytest.mark.parametrize("names,launcher,ssh_local", [
    (["zr-h2", "zr-h3"], Launcher.SSH, False),   # remote first host, by alias
    (["localhost", "zr-h2"], Launcher.SSH, False),  # this machine first, a remote host after it
    (["localhost", "zr-h3"], Launcher.SSH, True),   # this machine reached over SSH too
    (["localhost"], Launcher.LOCAL, False),
], ids=["remote-first", "local-first", "ssh-local", "local"])
def test_the_dry_run_plans_what_the_job_runs(aliases, monkeypatch, tmp_path, names, launcher, ssh_local):
    """The job's plan (prepare, preflight answered without an sshd) and the dry run's agree on every node's
    master address, port, node rank and world: one plan path, the port given (a port the job chooses at start
    is the one thing a dry run cannot know: the test above)."""
    config, _ = aliases
    monkeypatch.setattr(launch_job, "preflight", _fake_preflight(29556))
    hosts = [Host(n, 1) for n in names]
    script = tmp_path / "s.py"
    script.write_text("")
    job = Script(str(script))
    ssh = SshOptions(config=config)
    prepared = prepare(job, hosts, job_id="j1", master_port=29556, ssh=ssh, ssh_local=ssh_local, launcher=launcher)
    text = dry_run(job, hosts, master_port=29556, job_id="j1", launcher=launcher, ssh=ssh, ssh_local=ssh_local)
    printed = [shlex.split(x) for x in text.splitlines() if x and not x.startswith("#")]
    ran = [n.argv for n in prepared.plan.nodes]
    assert len(printed) == len(ran)
    for cmd, argv in zip(printed, ran):
        for name in ("master-addr", "master-port", "node-rank", "nnodes", "nproc-per-node"):
            assert option(cmd, name) == option(argv, name), name
    if names[0] == "zr-h2":
        assert prepared.plan.master_addr == "127.0.0.2"


@pytest.mark.parametrize("facts,expected", [
    # found by review: "version mismatch: torch None there, 2.13.0+cpu here" for a host without torch
    ({"torch": None}, "torch is not installed for /opt/py"),
    ({"zerorun": None, "torch": None}, "zerorun is not installed for /opt/py"),
    ({"torch": "2.1.0"}, "version mismatch: torch 2.1.0 there, 2.13.0 here"),
    ({"workdir": False}, "working directory missing: /work"),
    ({"missing": ["m"]}, "module missing: m"),
    ({}, None),
])
def test_what_the_preflight_probe_found_is_one_line(facts, expected):
    from zerorun.launch.preflight import facts_problem

    local = {"zerorun": "0.1.0", "torch": "2.13.0"}
    found = {**local, "workdir": True, "missing": [], **facts}
    assert facts_problem(found, local, "/opt/py", "/work") == expected
    assert facts_problem(found, local, "/opt/py", "/work", port=29500) == (
        expected or "master port 29500 is already in use there")  # the probe could not bind it (no "port")
    assert facts_problem({**found, "port": 29500}, local, "/opt/py", "/work", port=29500) == expected
