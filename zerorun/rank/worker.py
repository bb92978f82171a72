"""The rank entry point, started on every rank by torch's launcher: ``python -m zerorun.rank.worker --recipe-file F``.

It reads the resolved recipe and trains (``loop.py``: the process group, the user's model and data in zerorun's
ZeRO engine), reporting to the launcher only through telemetry events on stdout (``telemetry/events.py``).
Exit codes: 0 done, 1 crashed, 2 bad user input (model or data module).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import traceback
import warnings

from zerorun.errors import ZerorunError
from zerorun.launch.exiting import exit_now
from zerorun.recipe import Recipe
from zerorun.rank.stopsignal import STOPPED_EXIT, Stopped
from zerorun.rank.userload import below_the_user, raised_at
from zerorun.telemetry import rankstream
from zerorun.telemetry.events import emit


#: Wordings of a collective that failed because another rank went away or went quiet (Note [Blame] in
#: launch/blame.py). gloo (third_party/gloo/gloo/transport/tcp/pair.cc, unbound_buffer.cc): "Connection
#: closed by peer [addr]", "Read error [addr]: Connection reset by peer", "Socket Timeout", "Socket closed",
#: "Timed out waiting 30000ms for recv operation to complete", "Application timeout caused pair closure";
#: NCCL (ProcessGroupNCCL.cpp, nccl.h's ncclRemoteError): "Watchdog caught collective operation timeout:
#: WorkNCCL(...) ran for 30000 milliseconds before timing out", "Some NCCL operations have failed or timed out",
#: "NCCL communicator was aborted", "remote process exited or there was a network error"; the OS's
#: ECONNRESET/EPIPE/ECONNREFUSED texts.
_PEER_FAILURE = re.compile(
    r"connection (reset|closed|refused)|broken pipe|socket (timeout|closed)|timed out|timing out|"
    r"timeout caused pair closure|pair closure|collective operation timeout|"
    r"NCCL communicator was aborted|remote process exited|network error|ncclRemoteError|"
    r"ProcessGroup.*(abort|shut ?down)", re.I)


def is_peer_failure(e: BaseException) -> bool:
    """True for an error raised inside a collective because another rank went away (Note [Blame] in
    launch/blame.py): gloo's and NCCL's reset or closed connections, timeouts, pair closures, an aborted
    communicator (the wordings are listed at ``_PEER_FAILURE``)."""
    import torch.distributed as dist

    dist_error = getattr(dist, "DistError", ())
    return isinstance(e, dist_error) or bool(_PEER_FAILURE.search(str(e)))


def train(recipe: Recipe, rank: int) -> None:
    """Train ``recipe`` on this rank (:class:`zerorun.rank.loop.TrainingRun`); emits start, model_ready, step,
    eval and finish events. Imports torch."""
    from zerorun.rank.loop import TrainingRun

    TrainingRun(recipe, rank).run()


def read_recipe(path: str, environ=os.environ) -> Recipe:
    """The resolved recipe the launcher wrote to ``path``; a ``launch.env`` value written masked (``--dry-run``'s
    file: Note [Masked environment values]) is the one this rank's environment got from the command line."""
    from zerorun.recipe import MASK

    with open(path, encoding="utf-8") as f:
        data = json.loads(f.read())
    env = (data.get("launch") or {}).get("env") or {}
    for key, value in env.items():
        if value == MASK and key in environ:
            env[key] = environ[key]
    return Recipe.model_validate(data)


def main(argv: list[str] | None = None) -> int:
    """Parse ``--recipe-file`` (the resolved recipe as JSON, in a 0600 file the node's watcher wrote: never on
    a command line, Note [Node watcher] in launch/node.py), train, and return the exit code."""
    parser = argparse.ArgumentParser(prog="zerorun.rank.worker")
    parser.add_argument("--recipe-file", required=True)
    args = parser.parse_args(argv)
    from zerorun.zero import allocator

    allocator.configure()  # Note [Returning freed memory]: every runtime, baselines included, before torch allocates
    rank = int(os.environ.get("RANK", 0))
    rankstream.install(rank)  # Note [Rank streams] in telemetry/rankstream.py
    warnings.formatwarning = one_line_warning
    emit("phase", rank, phase="importing torch")  # Note [Rank phases] in telemetry/phases.py
    threads = os.environ.get("OMP_NUM_THREADS")
    try:
        if threads:
            import torch

            torch.set_num_threads(int(threads))
        train(read_recipe(args.recipe_file), rank)
        return 0
    except Stopped:  # SIGTERM, checkpoint saved (Note [Checkpoint on SIGTERM])
        return STOPPED_EXIT
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the launcher
        return report_failure(e, rank)
    finally:
        rankstream.finish()  # a last line without its newline is still shown


def report_failure(e: BaseException, rank: int) -> int:
    """Emit the error event for ``e`` (raised on ``rank``) and return the rank's exit code: 2 for a
    :class:`ZerorunError` (bad user input), 130 for Ctrl-C, else 1."""
    if isinstance(e, ZerorunError):
        emit("error", rank, type=type(e).__name__, message=str(e), user_error=True)
        return 2
    tb = traceback.format_exception(type(e), e, e.__traceback__)
    tb = "".join(tb).strip().splitlines()
    frame = raised_at(e)
    where = f"{frame.filename}:{frame.lineno} in {frame.name}" if frame else None
    emit("error", rank, type=type(e).__name__, message=str(e).strip().splitlines()[0] if str(e).strip() else "",
         traceback="\n".join(tb[-40:]), user_error=False, peer_failure=is_peer_failure(e), where=where)
    return 130 if isinstance(e, KeyboardInterrupt) else 1


def one_line_warning(message, category, filename: str, lineno: int, line: str | None = None) -> str:
    """A rank's warning as one line (``warnings.formatwarning``): ``Category: message``, with `` (at file:line)``
    where that is the user's code; Python's own form adds the source line, and for zerorun's warnings, raised on
    behalf of a torch operation, a place in torch (``torch/overrides.py``) that names nothing of the user's."""
    where = "" if below_the_user(filename) else f" (at {filename}:{lineno})"
    return f"{category.__name__}: {message}{where}\n"


if __name__ == "__main__":
    exit_now(main())
