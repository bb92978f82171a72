"""``python -m zerorun.launch.torchrun ARGS``: torch's launcher (``torch.distributed.run``, torchrun) with, on
node rank 0, the rendezvous store listening on the master address only.

Note [Rendezvous store address]: torchrun's static rendezvous makes node 0 host a ``TCPStore`` that listens on
every interface, so anyone who can reach the machine can read and write the job's store. ``TCPStore`` with
``multi_tenant=True`` shares one server per port within a process, so a store started first here, on a
socket bound to ``--master-addr``, is the one torchrun then uses. When that address cannot be bound on this
machine (e.g. a NAT address), torchrun's default is kept and a line says so.

Note [Rank exits]: torchrun reports the exit code of ranks that failed (its "Failures" summary) but says nothing
of a rank that exited 0 while its peers still run (``os._exit(0)`` in the middle of the job, no finish event):
its peers then fail in a collective, and the launcher could only guess that the quiet rank hung. Here every
rank that ends while torchrun still watches its ranks (not one it stops itself) is announced on the node's
output as soon as torchrun sees it (every ``--monitor-interval``): a ``@zerorun-node`` line (launch/node.py)
``{"rank": R, "exit_code": C}``, C negative for a signal, which the launcher's blame uses (Note [Blame] in
launch/blame.py: ``rank 1 exited (exit code 0) in the middle of the job``); in training, where every rank
must finish, such a rank fails the job when announced, not when its peers time out. A torch whose elastic agent
lacks the hooked methods runs unchanged, without the lines.

Note [Failure report]: when ranks fail, torchrun raises ``ChildFailedError`` with every failed rank's exit code
and the first observed failure, and prints them as a table. The launcher takes them as data instead of parsing
that table: before the error propagates (and the table is printed, for the user), one ``@zerorun-node`` line
``{"failures": [{"rank": R, "exit_code": C}, ...], "root_cause": R}`` (C negative for a signal) goes out,
which the launcher's blame reads (launch/observed.py, Note [Blame] in launch/blame.py).
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
import sys

from zerorun.launch.exiting import exit_now

#: the node watcher's private folder (launch/node.py), removed here when the watcher was killed.
NODE_DIR_ENV = "ZERORUN_NODE_DIR"
_stores: list = []  # kept alive for the life of the process


def _option(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg in ("-m",) or not arg.startswith("--"):
            return None  # the program's own arguments start here
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
    return None


def bind_store(master_addr: str, master_port: int) -> None:
    """Start the job's rendezvous store server on ``master_addr:master_port`` only (Note [Rendezvous store
    address]). Raises OSError when the address cannot be bound here."""
    from torch.distributed import TCPStore

    family, kind, proto, _, address = socket.getaddrinfo(master_addr, master_port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(512)
    except OSError:
        sock.close()
        raise
    _stores.append(TCPStore(master_addr, master_port, None, True, datetime.timedelta(seconds=300),
                            wait_for_workers=False, multi_tenant=True, master_listen_fd=sock.detach()))


def _terminate_once() -> None:
    """Note [One SIGTERM]: torchrun's handler raises on every SIGTERM; a second one (SLURM's time limit and the
    launcher's teardown both send one, launch/slurm_step.py) would interrupt its shutdown, which waits for the
    ranks to save their checkpoint (zerorun/rank/stopsignal.py), and leave them to the watcher's quicker SIGKILL.
    Here only the first SIGTERM/SIGINT/... raises; torchrun still sends its ranks SIGTERM and waits (30 s)."""
    from torch.distributed.elastic.multiprocessing import api

    original = api._terminate_process_handler
    seen: list[int] = []

    def once(signum, frame) -> None:
        if not seen:
            seen.append(signum)
            original(signum, frame)

    api._terminate_process_handler = once  # looked up when torchrun installs its handlers


def _announce_exits() -> None:
    """Note [Rank exits]: wrap torchrun's poll of its rank processes to print a line per rank that ended on
    its own, and its stop of the ranks so that the ranks it stops are not announced."""
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext

    from zerorun.launch.marks import NOTE_PREFIX

    capture, close = getattr(SubprocessContext, "_capture_process_failures", None), SubprocessContext._close
    if capture is None:
        return

    def capture_and_announce(self, done_local_ranks: set[int]) -> None:
        running = set(self._running_local_ranks)
        capture(self, done_local_ranks)
        if getattr(self, "_zerorun_stopping", False):
            return
        for local_rank in sorted(running & done_local_ranks):
            code = self.subprocess_handlers[local_rank].proc.returncode
            rank = self.envs.get(local_rank, {}).get("RANK", "")
            if code is not None and rank.isdigit():
                print(NOTE_PREFIX + json.dumps({"rank": int(rank), "exit_code": code}), flush=True)

    def stopping(self, *args, **kwargs):
        self._zerorun_stopping = True
        return close(self, *args, **kwargs)

    SubprocessContext._capture_process_failures = capture_and_announce
    SubprocessContext._close = stopping


def failure_report(error) -> dict:
    """Note [Failure report]: torchrun's ``ChildFailedError`` as data: the failed global ranks with their exit
    codes, and the first observed failure's rank."""
    return {"failures": [{"rank": int(rank), "exit_code": int(f.exitcode)} for rank, f in error.failures.items()],
            "root_cause": int(error.get_first_failure()[0])}


def main(argv: list[str]) -> None:
    """Bind node 0's store, then run torchrun with ``argv``."""
    if _option(argv, "--node-rank") == "0" and _option(argv, "--master-addr") and _option(argv, "--master-port"):
        addr, port = _option(argv, "--master-addr"), int(_option(argv, "--master-port"))
        try:
            bind_store(addr, port)
        except OSError as e:
            print(f"zerorun: cannot bind the rendezvous store to {addr}:{port} ({e.strerror}); torchrun's "
                  "default (every interface) is used", flush=True)
    _terminate_once()
    _announce_exits()
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    from zerorun.launch.marks import NOTE_PREFIX

    watcher = os.getppid()
    try:
        torchrun(argv)
    except ChildFailedError as e:
        print(NOTE_PREFIX + json.dumps(failure_report(e)), flush=True)
        raise
    finally:
        # the watcher was killed (Note [Node watcher]): nobody else removes its private folder (the recipe)
        folder = os.environ.get(NODE_DIR_ENV)
        if folder and os.getppid() != watcher:
            shutil.rmtree(folder, ignore_errors=True)


def hosts_store_for_others(argv: list[str]) -> bool:
    """Whether this agent holds the rendezvous store that other nodes' agents still use (node 0 of a job of
    several nodes): they may be finishing torchrun's exit barrier on it after this one returns."""
    nodes = (_option(argv, "--nnodes") or "1").split(":")[-1]
    return _option(argv, "--node-rank") in (None, "0") and nodes != "1"


if __name__ == "__main__":
    main(sys.argv[1:])
    # a failure ends as Python ends it (torchrun's error report, exit 1); node 0 of several keeps the store up
    # through its teardown, as before (Note [Exit without teardown])
    if not hosts_store_for_others(sys.argv[1:]):
        exit_now(0)
