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
from zerorun.recipe.hostfile import Host
from zerorun.launch.remote import HostKeyError, SshOptions, connection, root_cause, run_script, shell_script

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


class PreflightFailed(ZerorunError):
    """Preflight failed on some hosts: ``problems`` maps each one's name to its cause (one line); the message is
    a line per host, ``preflight: HOST: cause`` (a restart leaves them out: Note [Lost nodes] in
    launch/restart.py)."""

    def __init__(self, problems: dict[str, str]) -> None:
        super().__init__("\n".join(f"preflight: {name}: {why}" for name, why in problems.items()))
        self.problems = dict(problems)


@dataclass
class HostCheck:
    """What preflight found on one host: the open ``conn`` (None on failure), ``problem`` (one line, or None),
    and the probe's facts (``cpus``, ``port``: the master port found free there, when asked)."""

    host: Host
    conn: object | None = None
    problem: str | None = None
    facts: dict = field(default_factory=dict)


def describe_connect_error(e: BaseException, host: str, opts: SshOptions, timeout: float | None = None) -> str:
    """One line for why connecting to ``host`` failed: unknown host, unreachable, no answer within ``timeout``
    seconds (the connection's ``ConnectTimeout``), auth refused, a host key refused, another SSH error."""
    import paramiko

    timeout = timeout if timeout is not None else opts.connect_timeout
    if isinstance(e, HostKeyError):
        return f"host key refused: {e}"
    if isinstance(e, paramiko.BadHostKeyException):
        return (f"REMOTE HOST IDENTIFICATION HAS CHANGED: the host key of {e.hostname} is "
                f"{e.key.get_name()} {e.key.fingerprint}, not the one in known_hosts "
                f"({e.expected_key.fingerprint}); Host key verification failed (remove the old key from "
                "known_hosts if the change is expected)")
    if isinstance(e, socket.gaierror):
        return f"unknown host (cannot resolve {host!r})"
    if isinstance(e, paramiko.AuthenticationException):
        who = f" as {opts.user}" if opts.user else ""
        key = f" with key {opts.key}" if opts.key else ""
        return f"authentication refused{who}{key} ({e})"
    if isinstance(e, paramiko.ssh_exception.NoValidConnectionsError):
        return f"unreachable: connection refused ({', '.join(f'{a[0]}:{a[1]}' for a in e.errors)})"
    if isinstance(e, (socket.timeout, TimeoutError)) or (
            isinstance(e, paramiko.SSHException) and "banner" in str(e).lower()):
        return f"unreachable: no answer within {timeout:g} s (ConnectTimeout)"
    if isinstance(e, OSError):
        return f"unreachable: {e.strerror or e}"
    return f"SSH error: {type(e).__name__}: {e}"


def _check(check: HostCheck, opts: SshOptions, python: str, ask: dict, env: dict, local: dict,
           timeout: float) -> None:
    name = check.host.name
    conn, t0 = None, time.monotonic()
    try:
        conn = connection(name, opts)
        conn.open()
        conn.transport.set_keepalive(5)
        check.conn = conn
    except Exception as e:  # noqa: BLE001 - every connect failure becomes one line
        hop, via = conn, ""
        if conn is not None:  # a ProxyJump host that failed is named (the first hop is opened first)
            chain = [conn]
            while chain[-1].gateway is not None and not isinstance(chain[-1].gateway, str):
                chain.append(chain[-1].gateway)
            for h in reversed(chain[1:]):
                t = h.client.get_transport()
                if t is None or not t.is_authenticated():
                    hop, via = h, f"jump host {h.original_host}: "
                    break
        cause = root_cause(hop, e) if hop is not None else e
        if hop is not None and "No existing session" in str(cause) and \
                time.monotonic() - t0 >= 0.9 * hop.connect_timeout:
            cause = TimeoutError()  # paramiko's transport gave up waiting for the SSH banner
        check.problem = via + describe_connect_error(cause, name, opts, getattr(hop, "connect_timeout", None))
        return
    status, out = run_script(check.conn, shell_script([python, "-c", _PROBE, json.dumps(ask)], env),
                             timeout=timeout)
    line = next((x for x in reversed(out.splitlines()) if x.startswith("@zerorun-probe ")), None)
    if line is None:
        last = out.strip().splitlines()[-1] if out.strip() else "no output"
        check.problem = (f"python not found: {python}" if status == 127 else
                         f"probe failed (exit status {status}): {last}")
        return
    facts = check.facts = json.loads(line.split(" ", 1)[1])
    check.problem = facts_problem(facts, local, python, ask["workdir"], ask.get("port"))


def facts_problem(facts: dict, local: dict, python: str, workdir: str, port: int | None = None) -> str | None:
    """What the probe found (``facts``) that the job cannot run with, against this machine's versions
    (``local``), in one line (``port``: the master port it was asked to bind there); None when nothing."""
    for name in ("zerorun", "torch"):  # a package missing there is said so, not "version None"
        if facts[name] is None:
            return f"{name} is not installed for {python}"
        if facts[name] != local[name]:
            return f"version mismatch: {name} {facts[name]} there, {local[name]} here"
    if not facts["workdir"]:
        return f"working directory missing: {workdir}"
    if facts["missing"]:
        return f"module missing: {', '.join(facts['missing'])}"
    return f"master port {port} is already in use there" if port is not None and facts.get("port") is None else None


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
        PreflightFailed: one line per failing host, ``HOST: cause``; the connections that did open are closed.
    """
    local = local_versions()
    checks = [HostCheck(h) for h in hosts]
    threads = []
    for i, check in enumerate(checks):
        ask = {"workdir": workdir, "modules": modules, "port": port if i == 0 else None}
        t = threading.Thread(target=_check, args=(check, opts, python, ask, env, local, timeout),
                             daemon=True)
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
        raise PreflightFailed({c.host.name: c.problem for c in failed})
    return checks
