"""A throwaway OpenSSH server on loopback addresses, for launcher tests and benchmarks.

``LoopbackSshd(folder, addresses)`` generates a host key and client keys in ``folder``, starts ``sshd``
listening on ``addresses`` (127.0.0.x only) on one free port, and writes an SSH config (``config``) in which
each address is a host with that port, the authorized key and the current user, plus ``badkey`` (a key the
server refuses) and ``down`` (a port where nothing listens). Facts of these machines: sshd needs /run/sshd
and, with its keys under /tmp, ``StrictModes no``; its default MaxStartups drops concurrent connections
beyond ~10.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import time

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the process that started it dies (a killed test run leaves no sshd)."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class LoopbackSshd:
    """A running sshd; ``config`` is the path of the client SSH config; ``stop()`` ends it."""

    def __init__(self, folder: str, addresses: list[str]) -> None:
        assert all(a.startswith("127.") for a in addresses), "loopback only"
        os.makedirs(folder, exist_ok=True)
        os.makedirs("/run/sshd", exist_ok=True)
        self.folder, self.addresses = folder, addresses
        keys = {name: os.path.join(folder, name) for name in ("host_key", "client_key", "other_key")}
        for path in keys.values():
            if not os.path.exists(path):
                subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", path], check=True)
        self.key, self.other_key = keys["client_key"], keys["other_key"]
        with open(keys["client_key"] + ".pub") as f, open(os.path.join(folder, "authorized_keys"), "w") as out:
            out.write(f.read())
        self.port = _free_port(addresses[0])
        self.down_port = _free_port("127.0.0.1")  # bound and released: nothing listens there
        user = getpass.getuser()
        sshd_config = os.path.join(folder, "sshd_config")
        with open(sshd_config, "w") as f:
            f.write("".join(f"ListenAddress {a}:{self.port}\n" for a in addresses))
            f.write(f"HostKey {keys['host_key']}\nPidFile {folder}/sshd.pid\n"
                    f"AuthorizedKeysFile {folder}/authorized_keys\nStrictModes no\nUsePAM no\n"
                    "PasswordAuthentication no\nKbdInteractiveAuthentication no\nPubkeyAuthentication yes\n"
                    "PermitRootLogin prohibit-password\nMaxStartups 200:30:400\nMaxSessions 200\n"
                    "LogLevel ERROR\n")
        self.config = os.path.join(folder, "ssh_config")
        with open(self.config, "w") as f:
            common = (f"  Port {self.port}\n  User {user}\n  StrictHostKeyChecking no\n"
                      "  UserKnownHostsFile /dev/null\n")
            f.write(f"Host {' '.join(addresses)}\n{common}  IdentityFile {self.key}\n")
            f.write(f"Host badkey\n  HostName {addresses[0]}\n{common}  IdentityFile {self.other_key}\n")
            f.write(f"Host down\n  HostName 127.0.0.1\n  Port {self.down_port}\n  User {user}\n")
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", sshd_config], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=open(os.path.join(folder, "sshd.log"), "w"),
                                     preexec_fn=_die_with_parent)
        deadline = time.time() + 15
        for address in addresses:
            while True:
                try:
                    socket.create_connection((address, self.port), timeout=1).close()
                    break
                except OSError:
                    if self.proc.poll() is not None or time.time() > deadline:
                        raise RuntimeError(f"sshd did not start: {open(os.path.join(folder, 'sshd.log')).read()}")
                    time.sleep(0.05)

    def session_pids(self) -> list[int]:
        """PIDs of sshd's per-connection processes (children of the listener)."""
        import psutil

        return [c.pid for c in psutil.Process(self.proc.pid).children()]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
