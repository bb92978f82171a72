"""The node watcher: the process the launcher starts on every node (locally, or over SSH), which starts the
node's torchrun and watches both ends of it.

``python -m zerorun.launch.node [--spec-fd N]`` reads the node's spec, one JSON line, from fd N (default: the
first line of standard input): ``argv`` (torchrun's command line), ``env`` (the node's variables, the
recipe's ``launch.env`` included), ``files`` (name -> text: the resolved recipe) and ``mark``.

Note [Node watcher]: what the launcher cannot see from its side, this process sees on the node.
- Secrets stay off command lines: env values and the recipe arrive in the spec (a pipe, never argv, so
  ``ps`` and ``/proc/PID/cmdline`` show none of them), the recipe is written to a 0600 file in a private
  0700 folder (:data:`NODE_DIR` in argv is replaced by that folder), and the folder is removed at the end.
  torchrun's log folder lives there too (no ``/tmp/torchelastic_*`` left per run).
- torchrun killed (SIGKILL, OOM killer): its ranks, in sessions of their own, would train on as orphans and
  hold the node's output open. The watcher waits for torchrun's exit status; when torchrun is gone, every
  process marked with this node's :data:`NODE_ENV` is stopped (SIGTERM, then SIGKILL after
  :data:`GRACE_S`), and a ``@zerorun-node`` line tells the launcher why the node ended.
- The launcher gone (SIGKILLed, its machine or SSH connection lost): standard input is the launcher's pipe or
  SSH channel, never written after the spec, so end of file on it means the launcher is gone, and the node's
  processes are killed at once.
- The watcher itself killed (SIGKILL, OOM killer): torchrun gets SIGTERM from the kernel (``PR_SET_PDEATHSIG``,
  :func:`_die_with`) and stops its ranks, then removes the watcher's private folder (``ZERORUN_NODE_DIR``,
  launch/torchrun.py); the launcher sees the watcher's own signal (a local exit status, or
  SSH's ``exit-signal``) and names it: ``node 0 on HOST ended (its watcher was killed by SIGKILL)``.
The watcher exits with torchrun's exit code (128 + N for a signal N, as a shell reports it).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from zerorun.launch.marks import NODE_DIR, NODE_ENV, NOTE_PREFIX, marked_processes, signal_name
from zerorun import allocator  # torch-free: Note [Rank allocator]

#: seconds between SIGTERM and SIGKILL when the watcher stops its node's processes.
GRACE_S = 3.0



def stop_marked(mark: str, grace_s: float = GRACE_S) -> int:
    """SIGTERM every process marked ``NODE_ENV=mark``, SIGKILL what is left after ``grace_s`` seconds; return
    how many there were."""
    procs = marked_processes(mark, NODE_ENV)
    found = len(procs)
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        for p in procs:
            try:
                p.send_signal(sig)
            except Exception:  # noqa: BLE001 - gone already
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(_alive(p) for p in procs):
            time.sleep(0.05)
        procs = [p for p in procs if _alive(p)]
        if not procs:
            break
    return found


def _alive(p) -> bool:
    try:
        return p.is_running() and p.status() != "zombie"
    except Exception:  # noqa: BLE001 - psutil.NoSuchProcess
        return False


_libc = ctypes.CDLL(None, use_errno=True)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with(parent: int):
    """``preexec_fn`` for torchrun: the kernel sends it SIGTERM when the watcher (pid ``parent``) dies, even by
    SIGKILL (``PR_SET_PDEATHSIG``, prctl(2)); torchrun's SIGTERM handler then stops its ranks, which run in
    sessions of their own, so nothing trains on unsupervised. A watcher that died before the call is caught by
    the parent pid check."""

    def preexec() -> None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def write_private(folder: str, files: dict[str, str]) -> None:
    """Write ``files`` (name -> text) into ``folder``, each readable by this user only (0600)."""
    for name, text in files.items():
        fd = os.open(os.path.join(folder, os.path.basename(name)), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)


def read_stdin_line() -> bytes:
    """The first line of stdin (bytes, with its newline; shorter at end of input), read unbuffered, one byte at a
    time: the rest of stdin belongs to the launcher's watch and must stay unread."""
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(0, 1)
        if not chunk:
            break
        line += chunk
    return line


def main(argv: list[str]) -> int:
    """Run one node (Note [Node watcher]); return its exit code."""
    parser = argparse.ArgumentParser(prog="zerorun.launch.node")
    parser.add_argument("--spec-fd", type=int, default=None)
    args = parser.parse_args(argv)
    if args.spec_fd is not None:
        with os.fdopen(args.spec_fd, "rb") as f:
            spec = json.loads(f.readline())
    else:
        spec = json.loads(read_stdin_line())
    return run_node(spec)


def run_node(spec: dict) -> int:
    """Run the node of ``spec`` (``argv``, ``env``, ``files``, ``mark``: Note [Node watcher]) with the rest of
    standard input as the launcher's watch; return the node's exit code (128 + N for a signal N)."""
    mark = spec["mark"]
    folder = tempfile.mkdtemp(prefix=f"zerorun-{mark.replace(':', '-')}-")
    launcher_gone = threading.Event()
    try:
        write_private(folder, spec.get("files", {}))
        cmd = [a.replace(NODE_DIR, folder) for a in spec["argv"]]
        env = {**os.environ, **spec["env"], NODE_ENV: mark, "ZERORUN_NODE_DIR": folder}
        if allocator.ALLOCATOR_VAR in spec["env"]:  # Note [Rank allocator]: this node's libraries decide
            from zerorun.allocator import allocator_env, fallback_note, find_tcmalloc

            try:
                resolved = allocator_env(env, find_tcmalloc(), allocator.find_mimalloc())
            except ValueError as e:  # a value no check before launch saw, or a library this node lacks
                print(f"zerorun: node environment: {e}", flush=True)
                return 2
            if note := fallback_note(env, resolved, socket.gethostname()):
                print(note, flush=True)
            env.update(resolved)
        # SIGTERM/SIGINT reach torchrun too (the launcher signals the node's process group, or the marked
        # processes); the watcher outlives it to clean up. A handler, not SIG_IGN, which torchrun would inherit.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: None)
        try:
            child = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, preexec_fn=_die_with(os.getpid()))
        except OSError as e:
            print(f"zerorun: cannot start {cmd[0]}: {e.strerror}", flush=True)
            return 127

        def watch_launcher() -> None:
            try:
                while os.read(0, 65536):
                    pass
            except (OSError, ValueError):
                pass
            launcher_gone.set()
            stop_marked(mark, grace_s=0.0)

        threading.Thread(target=watch_launcher, daemon=True).start()
        while True:
            try:
                code = child.wait()
                break
            except InterruptedError:
                continue
        left = stop_marked(mark)
        if code < 0 and not launcher_gone.is_set():
            reason = f"its torchrun agent was killed by {signal_name(-code)}"
            if left:
                reason += f"; {left} orphaned rank process{'es' if left > 1 else ''} stopped"
            try:
                print(NOTE_PREFIX + json.dumps({"reason": reason}), flush=True)
            except OSError:
                pass
        return code if code >= 0 else 128 - code
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    status = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(status)  # the launcher watch thread may still be reading stdin
