"""Sharded checkpoints: what a checkpoint folder is and how it is written, read and checked.

Modules (each imports its siblings directly, never through this package):

- ``saving.py``: :func:`save`, atomic (Note [Atomic checkpoints]);
- ``loading.py``: :func:`load`, resharding to any world size and stage (Note [Exact resume]);
- ``consolidation.py``: :func:`consolidate`, the model as one ordinary state dict;
- ``files.py``: finding and checking checkpoint folders without the model, and :class:`DataPosition`, the
  data position a checkpoint records (torch-free: the launcher's);
- ``safety.py``: reading DCP files without unpickling anything (Note [Untrusted checkpoints]);
- ``lock.py``: one job at a time in a checkpoint folder (Note [Checkpoint folder lock]);
- ``resume.py``: the launcher's ``--resume`` lookup (Note [Resume lookup]).

This package re-exports the public names of the former ``zerorun/checkpoint.py`` lazily (Note [Lazy
re-exports]), so that ``from zerorun.checkpoint import save`` keeps working.

Note [Lazy re-exports]: the launcher imports ``checkpoint.files``, ``checkpoint.lock`` and ``checkpoint.resume``,
which need no torch, and importing any of them runs this ``__init__`` first: importing ``saving`` here would
import torch into the launcher (seconds of start-up; tests/test_cli_conventions.py checks that it does not). A
module ``__getattr__`` (PEP 562) imports the module that owns a name only when the name is first asked for.
"""

from __future__ import annotations

import importlib
from typing import Any

#: public name -> the submodule that defines it
_EXPORTS = {
    "save": "saving", "load": "loading", "consolidate": "consolidation",
    "DataPosition": "files", "FORMAT": "files", "MARKER": "files", "META": "files", "check": "files",
    "check_layout": "files", "latest": "files", "list_complete": "files", "read_meta": "files",
    "resolve": "files", "step_dir": "files",
    "SafeLoadPlanner": "safety", "SafeReader": "safety", "reason": "safety",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # asked once: a plain attribute from then on
    return value
