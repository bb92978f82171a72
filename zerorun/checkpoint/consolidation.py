"""Consolidating a sharded checkpoint into one ordinary state dict file (``zerorun consolidate``), without a
process group. Nothing is unpickled (Note [Untrusted checkpoints] in ``safety.py``)."""

from __future__ import annotations

import contextlib
import os
import warnings

import torch

from zerorun.checkpoint.files import check, resolve
from zerorun.checkpoint.safety import SafeLoadPlanner, SafeReader, reason, why_not_written
from zerorun.errors import ZerorunError


def consolidate(path: str, out: str) -> tuple[int, int]:
    """Write the model of the checkpoint at ``path`` (or the latest one in a folder of checkpoints) as one
    ordinary state dict, without a process group: parameters as saved (fp32 masters, float64 ones for float64
    parameters, frozen ones in their dtype) with their shapes, module buffers as
    saved, every ``state_dict`` key of the unsharded model (tied parameters under each name). ``out`` ends in
    ``.safetensors`` (safetensors) or ``.pt`` (``torch.save``); it is written under a temporary name, given
    the umask's permissions (``0666 & ~umask``) and renamed. Holds one copy of the model in memory.

    Returns:
        ``(tensors written, bytes of out)``.

    Raises:
        ZerorunError: bad output suffix, incomplete/truncated/unreadable checkpoint (naming file and key).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from zerorun.zero.state import dtype_of

    if not out.endswith((".safetensors", ".pt")):
        raise ZerorunError(f"--out {out}: the file name must end in .safetensors or .pt")
    path = resolve(path)
    meta = check(path)
    layout = meta["layout"]
    targets: dict[str, torch.Tensor] = {}
    shapes = {}
    for p in layout["params"]:
        try:  # as saved: the master's dtype (fp32, float64 for a float64 parameter), a frozen parameter's own
            dtype = dtype_of(str(p.get("dtype", "float32")))  # checkpoints before the layout named it: fp32
        except ValueError as e:
            raise ZerorunError(f"{path}: layout.params: {e}") from None
        targets[f"model/{p['name']}"] = torch.empty(int(torch.Size(p["shape"]).numel()), dtype=dtype)
        shapes[p["name"]] = p["shape"]
    for key, b in layout["buffers"].items():
        targets[f"model/{key}"] = torch.empty(b["shape"], dtype=dtype_of(b["dtype"]))
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            planner = SafeLoadPlanner()
            # a tensor of zero elements has nothing to read (no rank holds a part of it, so none saved it)
            dcp.load({k: t for k, t in targets.items() if t.numel()}, storage_reader=SafeReader(path),
                     planner=planner, no_dist=True)
    except (CheckpointException, RuntimeError, ValueError) as e:
        raise ZerorunError(f"{path}: cannot read the checkpoint: {reason(e)}") from None
    problem = planner.unwritten()
    if problem:
        raise ZerorunError(f"{path}: the checkpoint does not hold all of {problem}")
    state: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for key, name in layout["state_dict"]:
        t = targets[f"model/{name}"]
        if name in shapes:
            t = t.view(shapes[name])
        if name in used and out.endswith(".safetensors"):  # safetensors stores no shared tensors
            t = t.clone()
        used.add(name)
        state[key] = t
    _write(state, out, meta["step"])
    return len(state), os.path.getsize(out)


def _write(state: dict[str, torch.Tensor], out: str, step: int) -> None:
    """Write ``state`` to ``out`` (safetensors or ``torch.save`` by its suffix) under a temporary name, with the
    umask's permissions, then rename it.

    Raises:
        ZerorunError: ``out`` cannot be written (naming it and why).
    """
    from zerorun.files import apply_umask

    directory = os.path.dirname(os.path.abspath(out))
    above = next((d for d in _folders_above(directory) if os.path.exists(d) and not os.path.isdir(d)), None)
    if above is not None:
        raise ZerorunError(f"--out {out}: cannot write: {above} is a file, not a folder")
    tmp = os.path.join(directory, "." + os.path.basename(out) + ".tmp")
    try:
        os.makedirs(directory, exist_ok=True)
        if out.endswith(".safetensors"):
            from safetensors.torch import save_file

            save_file(state, tmp, metadata={"format": "pt", "zerorun_step": str(step)})
        else:
            with open(tmp, "wb") as f:  # a failed write raises from its OSError (torch says only "unexpected pos")
                torch.save(state, f)
        apply_umask(tmp)  # safetensors writes 0600 (zerorun/files.py)
        os.replace(tmp, out)
    except Exception as e:  # noqa: BLE001 - a full disk, a read-only folder: one line, and no partial file left
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise ZerorunError(f"--out {out}: cannot write: {why_not_written(e, directory)}") from None


def _folders_above(directory: str) -> list[str]:
    """``directory`` and every folder above it, nearest first."""
    out = [directory]
    while os.path.dirname(out[-1]) != out[-1]:
        out.append(os.path.dirname(out[-1]))
    return out
