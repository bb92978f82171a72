"""Preflight: before anything starts, check every remote host in parallel, within a time bound.

For each host: reachable and authenticated over SSH, the same zerorun and torch versions as the launcher,
the working directory and the user's modules present, and, on the first host, the master port (a free one
found there, or the one asked for checked). Every failure is one line naming the host and the cause, and
nothing is started when there is one.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field

from zerorun.errors import ZerorunError
from zerorun.hostfile import Host
from zerorun.launch.remote import SshOptions, connect, run_script, shell_script

#: run with ``python -c`` on each host; stdlib only, so that it can say what is missing.
_PROBE = r"""
import importlib.util, json, os, socket, sys
ask = json.loads(sys.argv[1])
out = {"cpus": os.cpu_count(), "python": sys.executable}
try:
    import zerorun
    out["zerorun"] = zerorun.__version__
except Exception as e:
    out["zerorun"] = None
try:
    from importlib.metadata import version
    out["torch"] = version("torch")
except Exception:
    out["torch"] = None
out["workdir"] = os.path.isdir(ask["workdir"])
if out["workdir"]:
    sys.path.insert(0, ask["workdir"])
missing = []
for m in ask["modules"]:
    if m.endswith(".py") or os.sep in m:
        found = os.path.isfile(m)
    else:
        try:
            found = importlib.util.find_spec(m) is not None
        except Exception:
            found = False
    if not found:
        missing.append(m)
out["missing"] = missing
if ask.get("port") is not None:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("", ask["port"]))
        out["port"] = s.getsockname()[1]
    except OSError:
        out["port"] = None
    s.close()
print("@zerorun-probe " + json.dumps(out))
"""


@dataclass
class HostCheck:
    """What preflight found on one host: the open ``conn`` (None on failure), ``problem`` (one line, or None),
    and the probe's facts (``cpus``, ``port``: the master port found free there, when asked)."""

    host: Host
    conn: object | None = None
    problem: str | None = None
    facts: dict = field(default_factory=dict)


def describe_connect_error(e: BaseException, host: str, opts: SshOptions) -> str:
    """One line for why connecting to ``host`` failed: unknown host, unreachable, auth refused, SSH error."""
    import paramiko

    if isinstance(e, socket.gaierror):
        return f"unknown host (cannot resolve {host!r})"
    if isinstance(e, paramiko.AuthenticationException):
        who = f" as {opts.user}" if opts.user else ""
        key = f" with key {opts.key}" if opts.key else ""
        return f"authentication refused{who}{key} ({e})"
    if isinstance(e, paramiko.ssh_exception.NoValidConnectionsError):
        return f"unreachable: connection refused ({', '.join(f'{a[0]}:{a[1]}' for a in e.errors)})"
    if isinstance(e, (socket.timeout, TimeoutError)):
        return f"unreachable: no answer within {opts.connect_timeout:g} s"
    if isinstance(e, OSError):
        return f"unreachable: {e.strerror or e}"
    return f"SSH error: {type(e).__name__}: {e}"


def _check(check: HostCheck, opts: SshOptions, python: str, ask: dict, env: dict, local: dict) -> None:
    name = check.host.name
    try:
        check.conn = connect(name, opts)
    except Exception as e:  # noqa: BLE001 - every connect failure becomes one line
        check.problem = describe_connect_error(e, name, opts)
        return
    status, out = run_script(check.conn, shell_script([python, "-c", _PROBE, json.dumps(ask)], env),
                             timeout=opts.connect_timeout)
    line = next((x for x in reversed(out.splitlines()) if x.startswith("@zerorun-probe ")), None)
    if line is None:
        last = out.strip().splitlines()[-1] if out.strip() else "no output"
        check.problem = (f"python not found: {python}" if status == 127 else
                         f"probe failed (exit status {status}): {last}")
        return
    facts = check.facts = json.loads(line.split(" ", 1)[1])
    if facts["zerorun"] is None:
        check.problem = f"zerorun is not installed for {python}"
    elif facts["zerorun"] != local["zerorun"]:
        check.problem = f"version mismatch: zerorun {facts['zerorun']} there, {local['zerorun']} here"
    elif facts["torch"] != local["torch"]:
        check.problem = f"version mismatch: torch {facts['torch']} there, {local['torch']} here"
    elif not facts["workdir"]:
        check.problem = f"working directory missing: {ask['workdir']}"
    elif facts["missing"]:
        check.problem = f"module missing: {', '.join(facts['missing'])}"
    elif ask.get("port") is not None and facts["port"] is None:
        check.problem = f"master port {ask['port']} is already in use there"


def local_versions() -> dict:
    """This machine's zerorun and torch versions (torch's from its metadata: importing it takes seconds)."""
    from importlib.metadata import version

    import zerorun

    return {"zerorun": zerorun.__version__, "torch": version("torch")}


def preflight(hosts: list[Host], opts: SshOptions, *, python: str, workdir: str, modules: list[str],
              env: dict[str, str], port: int | None = None, timeout: float = 15.0) -> list[HostCheck]:
    """Check ``hosts`` (the remote ones) in parallel, one thread per host, all within ``timeout`` seconds.

    Args:
        python: the interpreter the nodes run (its zerorun and torch versions are compared with ours).
        workdir: the working directory the nodes start in.
        modules: file paths or dotted modules the ranks import (the model module, a data module, a script).
        env: the forwarded environment (launch/env.py), e.g. PYTHONPATH, under which modules are looked up.
        port: on ``hosts[0]``: 0 = find a free port there (``facts["port"]``), N = check that N is free.

    Returns:
        One :class:`HostCheck` per host, in order, each with an open connection.

    Raises:
        ZerorunError: one line per failing host, ``HOST: cause``; the connections that did open are closed.
    """
    local = local_versions()
    checks = [HostCheck(h) for h in hosts]
    threads = []
    for i, check in enumerate(checks):
        ask = {"workdir": workdir, "modules": modules, "port": port if i == 0 else None}
        t = threading.Thread(target=_check, args=(check, opts, python, ask, env, local), daemon=True)
        t.start()
        threads.append(t)
    deadline = time.monotonic() + timeout
    for t, check in zip(threads, checks):
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            check.problem = f"no answer within the preflight time limit ({timeout:g} s)"
    failed = [c for c in checks if c.problem]
    if failed:
        for c in checks:
            if c.conn is not None:
                c.conn.close()
        raise ZerorunError("\n".join(f"preflight: {c.host.name}: {c.problem}" for c in failed))
    return checks
