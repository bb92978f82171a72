"""Nodes reached over SSH (fabric): one ``Connection`` per remote host (host keys checked as OpenSSH does,
:func:`check_host_keys`), the node's watcher (launch/node.py, which starts torchrun) started by a shell script
sent on the channel's standard input, its lines streamed like a local node's.

``RemoteNode`` is a ``Node`` (launch/nodes.py) as :class:`~zerorun.launch.runner.LocalNode` is, so the
supervisor treats both alike.

Note [Remote processes]: without a pty, a remote process survives its SSH connection closing; with one it
gets SIGHUP but its stdout and stderr are merged and rewritten (``\\r\\n``). So the channel has no pty, and
signals do not travel through it: every process of a job carries the job id in its environment
(``JOB_ENV``), and signalling a node, or verifying that nothing is left there, runs
``python -m zerorun.launch.remote signal JOB SIG`` on the host over a fresh channel (a fresh connection if
the first one is gone), which signals and counts the marked processes there (runner.signal_marked). A
connection lost while the node runs (exit status -1) is that node failing.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import shlex
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Mapping

from zerorun.errors import ZerorunError
from zerorun.launch.nodes import Ended, Line
from zerorun.launch.marks import JOB_ENV
from zerorun.launch.plan import NodeSpec

#: the exit code reported for a node whose SSH connection was lost (ssh's own code for a connection error).
LOST_CONNECTION = 255


@dataclass(frozen=True)
class SshOptions:
    """How to reach remote hosts. Unset fields come from the SSH config (``~/.ssh/config`` and
    ``/etc/ssh/ssh_config``, or ``config`` alone when given), as ``ssh`` itself reads them; ``key``, when
    given, is the only key tried. ``connect_timeout`` in seconds (None: the config's ``ConnectTimeout``, else
    :data:`DEFAULT_CONNECT_TIMEOUT`)."""

    user: str | None = None
    port: int | None = None
    key: str | None = None
    config: str | None = None
    connect_timeout: float | None = None


#: seconds to wait for a host's TCP connection and SSH banner when the SSH config sets no ``ConnectTimeout``.
DEFAULT_CONNECT_TIMEOUT = 10.0


class HostKeyError(Exception):
    """A host key that the SSH config's ``StrictHostKeyChecking`` refuses (unknown, or changed); the message
    is one line naming the host."""


class _UnknownKeyPolicy:
    """paramiko missing-host-key policy for a ``StrictHostKeyChecking`` setting: a key marked ``@revoked`` is
    refused always; ``no`` accepts an unknown key for this connection; ``accept-new`` adds it by appending one
    line to the user's known-hosts file (never rewriting it: its comments and ``@`` lines stay); ``yes`` and
    ``ask`` (there is no prompt) refuse it."""

    def __init__(self, setting: str, files: list[str], revoked: set[str]) -> None:
        self.setting, self.files, self.revoked = setting, files, revoked

    def missing_host_key(self, client, hostname, key) -> None:
        if key.get_base64() in self.revoked:
            raise HostKeyError(f"the host key of {hostname} ({key.get_name()} {key.fingerprint}) is marked "
                               f"@revoked in {' or '.join(self.files) or 'known_hosts'}: Host key verification "
                               "failed")
        if self.setting in ("no", "off", "false"):
            client.get_host_keys().add(hostname, key.get_name(), key)
            return
        if self.setting != "accept-new":
            raise HostKeyError(f"no host key is known for {hostname} ({key.get_name()} {key.fingerprint}) and "
                               f"StrictHostKeyChecking is {self.setting}: add it to "
                               f"{' or '.join(self.files) or '~/.ssh/known_hosts'} (ssh once, or ssh-keyscan), "
                               "or set StrictHostKeyChecking accept-new")
        client.get_host_keys().add(hostname, key.get_name(), key)
        if self.files and self.files[0] != os.devnull:
            try:  # as ssh does: create the file (and its folder) if needed, append the one line
                os.makedirs(os.path.dirname(self.files[0]) or ".", mode=0o700, exist_ok=True)
                fd = os.open(self.files[0], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                with os.fdopen(fd, "a") as f:
                    f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
            except OSError:
                pass  # accepted for this connection only, as ssh does when it cannot write the file


def read_known_hosts(paths: list[str]) -> tuple[list, set[str]]:
    """The host-key entries of OpenSSH known-hosts files, read as ``ssh`` reads them: ``(entries, revoked)``,
    ``entries`` as paramiko ``HostKeyEntry`` objects whose key is not revoked, ``revoked`` the base64 keys of
    ``@revoked`` lines. ``@cert-authority`` lines are skipped (paramiko does not check host certificates: a
    host behind one needs a plain key line), as are lines that do not parse and files that cannot be read."""
    from paramiko.hostkeys import HostKeyEntry

    entries, revoked = [], set()
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for lineno, line in enumerate(lines, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith("@"):
                fields = line.split()
                if fields[0] == "@revoked" and len(fields) >= 4:
                    revoked.add(fields[3])
                continue
            try:
                entry = HostKeyEntry.from_line(line, lineno)
            except Exception:  # noqa: BLE001 - paramiko raises several kinds for a line it cannot read
                continue
            if entry is not None and entry.key is not None:
                entries.append(entry)
    return [e for e in entries if e.key.get_base64() not in revoked], revoked


def known_hosts_files(ssh_config: Mapping) -> tuple[list[str], list[str]]:
    """The user's and the global known-hosts files an SSH config names (``UserKnownHostsFile``,
    ``GlobalKnownHostsFile``; OpenSSH's defaults when unset), ``~`` expanded."""
    def files(key: str, default: str) -> list[str]:
        value = ssh_config.get(key, default)
        value = " ".join(value) if isinstance(value, list) else str(value)
        return [os.path.expanduser(f) for f in value.split()]

    return (files("userknownhostsfile", "~/.ssh/known_hosts ~/.ssh/known_hosts2"),
            files("globalknownhostsfile", "/etc/ssh/ssh_known_hosts /etc/ssh/ssh_known_hosts2"))


def check_host_keys(conn) -> None:
    """Make ``conn`` (a fabric ``Connection``, its ``ProxyJump`` gateways too) check host keys as OpenSSH does
    with the same config, instead of fabric's accept-anything: the known-hosts files are loaded, a changed key
    is always refused (paramiko's ``BadHostKeyException``), and an unknown one is refused under
    ``StrictHostKeyChecking`` ``yes`` or ``ask`` (the default), added to the user's file under ``accept-new``
    (one line appended), accepted under ``no``/``off``; a key marked ``@revoked`` is refused, ``@cert-authority``
    lines are skipped (:func:`read_known_hosts`). Under ``no`` a changed or revoked key is refused too, where
    OpenSSH only warns (changed) and goes on: stricter than OpenSSH, on purpose."""
    setting = str(conn.ssh_config.get("stricthostkeychecking", "ask")).lower()
    client = conn.client
    user_files, global_files = known_hosts_files(conn.ssh_config)
    entries, revoked = read_known_hosts(global_files + user_files)
    known = client.get_host_keys()  # never saved back by paramiko: accept-new appends a line itself
    for entry in entries:
        for name in entry.hostnames:
            known.add(name, entry.key.get_name(), entry.key)
    client.set_missing_host_key_policy(_UnknownKeyPolicy(setting, user_files, revoked))
    gateway = conn.gateway
    if gateway is not None and not isinstance(gateway, str):
        check_host_keys(gateway)


def connection(host: str, opts: SshOptions):
    """A fabric ``Connection`` to ``host`` (an address or an SSH config alias), not yet open, with host keys
    checked (:func:`check_host_keys`), ``ProxyJump`` as the SSH config says, and ``connect_timeout`` (also the
    SSH banner's timeout) from ``opts``, else the config's ``ConnectTimeout``, else
    :data:`DEFAULT_CONNECT_TIMEOUT`."""
    import logging

    from fabric import Config, Connection

    logging.getLogger("paramiko").addHandler(logging.NullHandler())  # errors are reported as one line each
    config = Config(runtime_ssh_path=opts.config) if opts.config else Config()
    connect_kwargs: dict = {}
    if opts.key:
        connect_kwargs = {"key_filename": [opts.key], "look_for_keys": False, "allow_agent": False}
    conn = Connection(host, user=opts.user, port=opts.port, config=config, connect_timeout=opts.connect_timeout,
                      connect_kwargs=connect_kwargs)
    hops = [conn]
    while hops[-1].gateway is not None and not isinstance(hops[-1].gateway, str):
        hops.append(hops[-1].gateway)
    for hop in hops:
        if hop.connect_timeout is None:
            hop.connect_timeout = DEFAULT_CONNECT_TIMEOUT
        hop.connect_kwargs.setdefault("banner_timeout", hop.connect_timeout)
        hop.connect_kwargs.setdefault("auth_timeout", hop.connect_timeout)
    check_host_keys(conn)
    return conn


def root_cause(conn, error: BaseException) -> BaseException:
    """The exception that really ended ``conn``'s (or a gateway's) attempt to open: paramiko reports a
    transport that died while reading the banner as a later "No existing session"; the transport keeps the
    first one."""
    hop = conn
    while hop is not None and not isinstance(hop, str):
        transport = hop.client.get_transport()
        saved = getattr(transport, "saved_exception", None) if transport is not None else None
        if saved is not None:
            return saved
        hop = hop.gateway
    return error


def connect(host: str, opts: SshOptions):
    """An open ``fabric.Connection`` to ``host`` (:func:`connection`).

    Raises:
        OSError, paramiko.SSHException (AuthenticationException and BadHostKeyException included),
            HostKeyError: see :func:`zerorun.launch.preflight.describe_connect_error` for the one-line causes.
    """
    conn = connection(host, opts)
    conn.open()
    conn.transport.set_keepalive(5)  # a dead peer is noticed within seconds, not at the next write
    return conn


def _record_exit_signal(channel) -> None:
    """Keep the signal name of SSH's ``exit-signal`` request (RFC 4254 6.10: a remote command killed by a
    signal) as ``channel.zerorun_exit_signal`` (``"KILL"``): paramiko drops the request, and without it a
    killed watcher would look like a lost connection. Done in the transport's dispatch table (of this
    transport only), which paramiko calls with the channel."""
    from paramiko.common import MSG_CHANNEL_REQUEST

    transport = channel.get_transport()
    table = transport._channel_handler_table
    handle = table[MSG_CHANNEL_REQUEST]
    if getattr(handle, "zerorun", False):
        return

    def handle_request(chan, m):
        start = m.packet.tell()
        try:
            if m.get_text() == "exit-signal":
                m.get_boolean()  # want reply
                chan.zerorun_exit_signal = m.get_text()
        except Exception:  # noqa: BLE001 - a malformed request is paramiko's to refuse
            pass
        m.packet.seek(start)
        return handle(chan, m)

    handle_request.zerorun = True
    transport._channel_handler_table = {**table, MSG_CHANNEL_REQUEST: handle_request}


def shell_script(argv: list[str], env: Mapping[str, str], workdir: str | None = None) -> str:
    """A POSIX shell script that changes to ``workdir``, exports ``env`` and replaces itself with ``argv``;
    every value quoted with :func:`shlex.quote` (Note [Forwarded environment] in launch/env.py)."""
    lines = ["set -e"]
    if workdir:
        lines.append(f"cd {shlex.quote(workdir)}")
    lines += [f"export {key}={shlex.quote(value)}" for key, value in env.items()]
    lines.append("exec " + " ".join(shlex.quote(a) for a in argv))
    return "\n".join(lines) + "\n"


def node_script(spec: NodeSpec, forwarded: Mapping[str, str], workdir: str | None) -> str:
    """The shell script that starts ``spec``'s watcher (launch/node.py) with the launcher's ``forwarded``
    variables exported and the node's spec as a here-document on fd 3 (one line of JSON, under a random
    delimiter that cannot occur in it)."""
    from zerorun.launch.runner import node_spec_json, watcher_argv

    tag = f"ZERORUN_SPEC_{uuid.uuid4().hex}"
    script = shell_script(watcher_argv(spec, spec_fd=3), forwarded, workdir)
    return script.rstrip("\n") + f" 3<<'{tag}'\n{node_spec_json(spec)}\n{tag}\n"


def run_script(conn, script: str, timeout: float) -> tuple[int, str]:
    """Run ``script`` with ``sh`` on ``conn``'s host; return its exit status (-1: the connection was lost or
    ``timeout`` seconds passed) and its output (stdout and stderr merged)."""
    channel = conn.create_session()
    try:
        channel.set_combine_stderr(True)
        channel.settimeout(timeout)
        channel.exec_command("sh -s")
        channel.sendall(script.encode())
        channel.shutdown_write()
        deadline, chunks = time.monotonic() + timeout, []
        while time.monotonic() < deadline:
            chunk = channel.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
        # the exit status comes just after the end of the output: wait for it, within the time left
        channel.status_event.wait(max(0.0, deadline - time.monotonic()))
        status = channel.recv_exit_status() if channel.exit_status_ready() else -1
        return status, b"".join(chunks).decode(errors="replace")
    except OSError:  # socket.timeout included
        return -1, ""
    finally:
        channel.close()


class RemoteNode:
    """A node on a remote host: its torchrun runs over ``conn`` (a fabric ``Connection``).

    Args:
        spec: the node (its ``env`` holds zerorun's variables and the recipe's ``launch.env``).
        lines: queue receiving a ``Line`` per line and, at the end, an ``Ended`` (launch/nodes.py).
        conn: an open connection to ``spec.host``.
        ssh: options to reconnect with, for teardown after a lost connection.
        forwarded: the launcher's variables that cross (launch/env.py), under ``spec.env``.
        workdir: the directory torchrun starts in (default: the launcher's).
    """

    def __init__(self, spec: NodeSpec, lines: "queue.Queue", conn, ssh: SshOptions,
                 forwarded: Mapping[str, str], workdir: str | None = None) -> None:
        self.spec, self.lines, self.conn, self.ssh = spec, lines, conn, ssh
        self.forwarded = dict(forwarded)
        self.workdir = workdir or os.getcwd()
        self.returncode: int | None = None
        self.end_reason: str | None = None  # set when the node ended for a reason its exit code does not say
        self.unverified: str | None = None  # set when teardown could not reach the host
        self._channel = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the node's watcher on the host (Note [Node watcher] in launch/node.py), which starts torchrun;
        a reader thread streams its lines to the queue. The script is sent on the channel's standard input
        and the node's spec (its env and the recipe) follows as a here-document on the watcher's fd 3, so no
        value is on a command line; the channel's input stays open: its end tells the watcher that the
        launcher is gone."""
        script = node_script(self.spec, self.forwarded, self.workdir)
        try:
            channel = self.conn.create_session()
            channel.set_combine_stderr(True)
            _record_exit_signal(channel)
            channel.exec_command("sh -s")
            channel.sendall(script.encode())
        except Exception as e:  # noqa: BLE001 - paramiko raises SSHException, EOFError, OSError
            raise ZerorunError(f"node {self.spec.node_rank} ({self.spec.host.name}): cannot start over SSH: "
                               f"{type(e).__name__}: {e}") from None
        self._channel = channel
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        channel = self._channel
        for raw in channel.makefile("rb"):
            self.lines.put(Line(self.spec.node_rank, raw.decode(errors="replace").rstrip("\r\n")))
        status = channel.recv_exit_status()
        killed = getattr(channel, "zerorun_exit_signal", None)
        if status == -1 and killed:  # the watcher itself was killed (the script execs it): SSH's exit-signal
            self.end_reason = f"its watcher was killed by SIG{killed}"
            status = 128 + getattr(signal.Signals, f"SIG{killed}", 0)
        elif status == -1:  # the channel closed without an exit status: the connection is gone
            status = LOST_CONNECTION
            self.end_reason = f"lost the SSH connection to {self.spec.host.name}"
        self.returncode = status
        self.lines.put(Ended(self.spec.node_rank, status, self.end_reason))

    def _signal_marked(self, sig: int) -> int:
        """Run the signal helper on the host (Note [Remote processes]); return the count it printed, or 0
        with ``unverified`` set when the host cannot be reached."""
        argv = [self.spec.argv[0], "-m", "zerorun.launch.remote", "signal", self.spec.env[JOB_ENV], str(int(sig))]
        script = shell_script(argv, self.forwarded)
        for attempt in range(2):
            with self._lock:
                try:
                    if attempt or not (self.conn.transport and self.conn.transport.is_active()):
                        self.conn = connect(self.spec.host.name, dataclasses.replace(self.ssh, connect_timeout=3.0))
                    status, out = run_script(self.conn, script, timeout=8.0)
                except Exception as e:  # noqa: BLE001 - unreachable, refused, timed out
                    self.unverified = f"{type(e).__name__}: {e}"
                    continue
            words = out.split()
            if status == 0 and words and words[-1].isdigit():
                self.unverified = None
                return int(words[-1])
            self.unverified = f"signal helper exited {status}: {out.strip()[-200:]}"
        return 0

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to every process of the job on this host while the node runs (after it ended,
        teardown reaches what is left with :meth:`kill_survivors`)."""
        if self.returncode is None:
            self._signal_marked(sig)

    def kill_survivors(self, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` (0: none, only count) to every surviving process of the job on this host; return how
        many there were (0 also when the host cannot be reached: see ``unverified``)."""
        return self._signal_marked(sig)

    def close(self) -> None:
        """Close the SSH connection."""
        self.conn.close()


def _main(argv: list[str]) -> int:
    """``signal JOB_ID SIG``: signal every process marked with JOB_ID on this host and print how many."""
    from zerorun.launch.marks import signal_marked

    if len(argv) != 3 or argv[0] != "signal" or not argv[2].isdigit():
        print("usage: python -m zerorun.launch.remote signal JOB_ID SIGNAL", file=sys.stderr)
        return 2
    print(signal_marked(argv[1], int(argv[2])))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
