"""Runs a user's own training script on one rank for ``zerorun launch``: ``python -m zerorun.rank.script_worker
SCRIPT [ARGS...]`` (or ``-m MODULE [ARGS...]``, as ``python -m MODULE`` runs it), started by torchrun like the
built-in worker.

The script runs as ``__main__`` with ``sys.argv == [SCRIPT, *ARGS]`` and its folder on ``sys.path``, as
``python SCRIPT`` would run it; its output lines are prefixed with ``[rank R]`` and an uncaught exception is
reported as an error event naming the file and line (the same path as the built-in worker), so the launcher
blames the right rank. Scripts report progress with :func:`zerorun.report`.
"""

from __future__ import annotations

import os
import runpy
import socket
import sys
from importlib import metadata

from zerorun.telemetry import rankstream
from zerorun.telemetry.events import emit
from zerorun.telemetry.probes import host_memory
from zerorun.rank.worker import report_failure
from zerorun import allocator


def main(argv: list[str]) -> int:
    """Run ``argv[0]`` with arguments ``argv[1:]``; return the rank's exit code (the script's own
    ``sys.exit`` code, or :func:`zerorun.rank.worker.report_failure`'s). A rank that ends with 0 emits a finish
    event, so the launcher shows it done (and knows when it ended); every rank emits a start event first."""
    rank = int(os.environ.get("RANK", 0))
    emit("start", rank, host=socket.gethostname(), pid=os.getpid(), torch=_torch_version(),
         allocator=allocator.name(), world_size=int(os.environ.get("WORLD_SIZE", 1)),
         local_rank=int(os.environ.get("LOCAL_RANK", 0)),
         **host_memory())  # the launcher and `zerorun show` see the rank start, whatever the script reports
    emit("phase", rank, phase="running the script")  # Note [Rank phases] in telemetry/phases.py
    code = _run(argv)
    if code == 0:
        emit("finish", int(os.environ.get("RANK", 0)), exit_code=0)
    return code


def _torch_version() -> str:
    """torch's version without importing torch (the script imports it when it needs it)."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "?"


def _run(argv: list[str]) -> int:
    rank = int(os.environ.get("RANK", 0))
    rankstream.install(rank)  # Note [Rank streams] in telemetry/rankstream.py: text streams as under torchrun
    module = argv[0] == "-m"
    if module:
        argv = argv[1:]
    sys.argv = list(argv)
    try:
        if module:  # as `python -m MODULE`: the working directory first on sys.path, argv[0] the module's file
            sys.path.insert(0, os.getcwd())
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the launcher
        return report_failure(e, rank)
    finally:
        rankstream.finish()  # a last line without its newline is still shown
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
