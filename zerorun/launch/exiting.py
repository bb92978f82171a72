"""How zerorun's processes that hold torch end: without the interpreter's teardown.

Note [Exit without teardown]: a normal interpreter exit tears down every module; with torch loaded (and
torch._dynamo, which torch.optim's constructor imports) that takes 0.7-0.8 s per process on an idle 2-core
machine (0.02 s with ``os._exit``), after the work is done. A rank and torchrun's agent end one after the
other, so a job's end waited about 1.9 s from the ranks' finish events to the launcher's exit (a 2-rank tiny
job on this machine), now about 0.8 s. They end the way multiprocessing ends its children: the atexit handlers
run (the offload swap files' finalizers, logging's flush), the standard streams are flushed, then
``os._exit``. Nothing is left to the teardown: a rank has closed its engine, destroyed its process group and
written every event before it ends; a thread still running then is the engine's idle swap reader or a
failure's leftovers. A user's own script (``zerorun launch``) ends as Python ends it, and so does the agent of
node 0 in a job of several nodes: it holds the rendezvous store, which the other agents may still use for
torchrun's exit barrier after it returns.
"""

from __future__ import annotations

import atexit
import os
import sys


def exit_now(code: int) -> None:
    """End this process with exit status ``code`` (Note [Exit without teardown]); never returns."""
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said there
                pass
        os._exit(code)
