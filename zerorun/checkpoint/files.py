"""Checkpoint folders on disk, without the model: which ones are complete, the latest, and the checks that need
no model (``zerorun.json``, file sizes and SHA-256, DCP metadata, layout), and the data position a checkpoint
records. Saving and loading are ``saving.py``'s and ``loading.py``'s (Note [Atomic checkpoints] in ``saving.py``
says what makes a folder complete)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

from zerorun.errors import ZerorunError

MARKER = "COMPLETE"
META = "zerorun.json"
#: every name a save writes into a step folder: DCP's metadata and data files, META, MARKER
SAVED = re.compile(rf"\.metadata|__\d+_\d+\.distcp|{re.escape(META)}|{MARKER}")
FORMAT = 1
STEP_DIR = re.compile(r"step-(\d+)")  # fullmatch


@dataclass
class DataPosition:
    """Where a rank is in the training data: ``epoch`` and micro-batches of it consumed (``batch``); saved in
    ``zerorun.json``'s ``data`` (Note [Exact resume] in ``saving.py``)."""

    epoch: int = 0
    batch: int = 0


def step_dir(root: str, step: int) -> str:
    """The folder of the checkpoint of ``step`` under ``root``."""
    return os.path.join(root, f"step-{step:08d}")


# ----------------------------------------------------------------------------------------------- reading
def read_meta(path: str) -> dict[str, Any]:
    """``zerorun.json`` of the checkpoint at ``path``, after checking that the checkpoint is complete.

    Raises:
        ZerorunError: no such folder, a folder of checkpoints (naming its newest complete one), one with no
            checkpoint file, no ``COMPLETE`` marker (half-written), unreadable or malformed JSON.
    """
    _check_folder(path)
    if not os.path.isfile(os.path.join(path, MARKER)):
        raise ZerorunError(_not_complete(path))
    meta_path = os.path.join(path, META)
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except OSError as e:
        raise ZerorunError(f"{meta_path}: cannot read: {e.strerror}") from None
    except ValueError as e:
        raise ZerorunError(f"{meta_path}: not valid JSON ({e})") from None
    missing = [k for k in ("format", "step", "world_size", "layout", "scheduler", "data") if k not in meta]
    if not isinstance(meta, dict) or missing or meta.get("format") != FORMAT:
        raise ZerorunError(f"{meta_path}: not a zerorun checkpoint of format {FORMAT}"
                           + (f" (missing key {missing[0]!r})" if missing else ""))
    marker = _marker(path)
    _check_step(path, meta["step"], meta_path, marker.get("step"))
    if isinstance(marker.get("sha256"), str) and marker["sha256"] != _sha256(meta_path):  # older ones hold none
        raise ZerorunError(f"{meta_path}: changed since it was saved (its SHA-256 differs from the {MARKER} "
                           "marker's): edited by hand? refusing the checkpoint")
    return meta


def _marker(path: str) -> dict[str, Any]:
    """The ``COMPLETE`` marker's content (``step``, ``saved_at``, ``sha256`` of ``zerorun.json``), ``{}`` when it
    is unreadable (a marker is its existence first)."""
    try:
        with open(os.path.join(path, MARKER), encoding="utf-8") as f:
            marker = json.load(f)
    except (OSError, ValueError):
        return {}
    return marker if isinstance(marker, dict) else {}


def _check_folder(path: str) -> None:
    """Raises ZerorunError unless ``path`` is a folder: a file (a checkpoint's shard, a consolidated one) or nothing,
    in one line (the default folder of a job that saved nothing, most often: a new user's review)."""
    if os.path.isfile(path):
        raise ZerorunError(f"{path}: a file, not a checkpoint folder: give the step-N folder that holds it, or the "
                           "folder of step-N folders")
    if not os.path.isdir(path):
        saved = " (a job saves checkpoints only with checkpoint.every or checkpoint.dir set)" if \
            os.path.basename(path) == "checkpoints" else ""
        raise ZerorunError(f"{path}: no such checkpoint directory{saved}")


def _not_complete(path: str) -> str:
    """Why the folder ``path``, which has no ``COMPLETE`` marker, is no checkpoint to load, in one line."""
    names = os.listdir(path)
    if any(STEP_DIR.fullmatch(n) for n in names):
        newest = latest(path)
        return f"{path}: a folder of checkpoints, not a checkpoint: " + (
            f"pass one of its step-N folders, e.g. the newest complete one, {newest}" if newest else
            f"none of its step-N folders is complete (each lacks its {MARKER} marker)")
    if not any(n in (META, ".metadata") or n.endswith(".distcp") for n in names):
        inside = f" (a run's folder: its checkpoints are in {path}/checkpoints)" if "checkpoints" in names else ""
        return f"{path}: not a checkpoint (no {META}, .metadata or .distcp file in it){inside}"
    return f"{path}: not a complete checkpoint (no {MARKER} marker: its save did not finish)"


def _check_step(path: str, step: Any, meta_path: str, marked: Any) -> None:
    """``zerorun.json``'s ``step``: a whole number, the same as the folder's name (``step-00000574``, when it has
    that form) and the ``COMPLETE`` marker's ``step`` (``marked``, when it holds one), both written by the same
    save.

    Raises:
        ZerorunError: naming ``zerorun.json`` and what it disagrees with (a hand-edited step resumed "after
            step 57" on step 574's weights).
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ZerorunError(f"{meta_path}: step: expected a whole number of steps, got {step!r}")
    others = []
    m = STEP_DIR.fullmatch(os.path.basename(os.path.normpath(path)))
    if m and int(m.group(1)) != step:
        others.append(f"the folder's name {m.group(0)}")
    if isinstance(marked, int) and marked != step:
        others.append(f"its {MARKER} marker's step {marked}")
    if others:
        raise ZerorunError(f"{meta_path}: step {step} differs from {' and '.join(others)}: the checkpoint is "
                           "inconsistent (edited by hand?); refusing it")


def list_complete(root: str) -> list[tuple[float, int, str]]:
    """Complete checkpoints under ``root`` as ``(saved_at, step, path)``, oldest save first."""
    found = []
    try:
        names = os.listdir(root)
    except OSError:
        return []
    for name in names:
        m = STEP_DIR.fullmatch(name)
        marker = os.path.join(root, name, MARKER)
        if m and os.path.isfile(marker):
            try:
                with open(marker, encoding="utf-8") as f:
                    saved_at = float(json.load(f)["saved_at"])
            except (OSError, ValueError, KeyError, TypeError):
                saved_at = os.path.getmtime(marker)
            found.append((saved_at, int(m.group(1)), os.path.join(root, name)))
    return sorted(found)


def latest(root: str) -> str | None:
    """The most recently completed checkpoint under ``root`` (Note [Atomic checkpoints]), or ``None``."""
    found = list_complete(root)
    return found[-1][2] if found else None


def resolve(path: str) -> str:
    """``path`` made absolute; a folder of checkpoints (no ``zerorun.json`` of its own, ``step-*`` inside)
    stands for its latest complete checkpoint.

    Raises:
        ZerorunError: missing folder, or a folder of checkpoints none of which is complete.
    """
    path = os.path.abspath(os.path.expanduser(path))
    _check_folder(path)
    if not os.path.exists(os.path.join(path, META)) and any(STEP_DIR.fullmatch(n) for n in os.listdir(path)):
        found = latest(path)
        if found is None:
            raise ZerorunError(f"{path}: no complete checkpoint in it (every step-* folder lacks its {MARKER} marker)")
        return found
    return path


def check(path: str) -> dict[str, Any]:
    """Everything about the checkpoint at ``path`` that can be checked without the model: complete, JSON
    readable, every file's size and SHA-256 as saved (``files`` in ``zerorun.json``), DCP metadata readable,
    no data file truncated. Returns ``zerorun.json``'s content.

    Raises:
        ZerorunError: naming the file that is missing, truncated or changed since the save.
    """
    meta = read_meta(path)
    from zerorun.checkpoint.safety import SafeReader

    metadata = SafeReader(path).check_files()  # first: it names the key a truncated file cuts, refuses bad pickles
    check_layout(meta, metadata, os.path.join(path, META))
    _check_fields(meta, os.path.join(path, META), {k.split("/")[1] for k in metadata.state_dict_metadata
                                                   if k.startswith("rng/") and k.count("/") == 2})
    files = meta.get("files")
    if not isinstance(files, dict):
        raise ZerorunError(f"{os.path.join(path, META)}: files: expected a mapping of file names, got {files!r}")
    # every file DCP reads is checked: one left out of the list would load unchecked (found by review)
    for name in sorted({".metadata"} | {info.relative_path for info in metadata.storage_data.values()}):
        if name not in files:
            raise ZerorunError(f"{os.path.join(path, META)}: files: {name} is not listed (a checkpoint lists every "
                               "file it was saved with, with its size and SHA-256): edited by hand? refusing it")
    for name, want in files.items():
        file = _confined(path, name, want)
        if not os.path.isfile(file):
            raise ZerorunError(f"{file}: missing (the checkpoint was saved with it)")
        if os.path.getsize(file) != want["bytes"] or _sha256(file) != want["sha256"]:
            raise ZerorunError(f"{file}: changed since it was saved (size or SHA-256 differs): corrupted or "
                               "truncated; resume from another checkpoint")
    return meta


def _count(value: Any, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _finite(values: Any) -> bool:
    return isinstance(values, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                            and math.isfinite(x) for x in values)


def _check_fields(meta: dict[str, Any], where: str, rng_ranks: set[str]) -> None:
    """The fields of ``zerorun.json`` the ranks read besides the layout: ``world_size`` (the ranks whose RNG
    states DCP holds: ``rng/R/...``, one set per rank), ``data`` (Note [Exact resume] in saving.py), the LR
    scheduler's state (torch's ``LambdaLR``: its rates, counters and one entry per param group),
    ``skipped_steps``, ``loss_scaler``: a hand edit is one line naming the field, not a rank's traceback or a
    silently different run. The ranks also turn a scheduler state torch refuses into one line (loading.py).

    Raises:
        ZerorunError: naming ``where`` and the field.
    """
    data, sched, world = meta.get("data"), meta.get("scheduler"), meta["world_size"]
    counts = [("world_size", world, 1), ("skipped_steps", meta.get("skipped_steps", 0), 0)]
    bad = [(f, repr(v)) for f, v, least in counts if not _count(v, least)]
    if not bad and rng_ranks and rng_ranks != {str(r) for r in range(world)}:
        bad.append(("world_size", f"{world} with the RNG states of {len(rng_ranks)} ranks"))
    if not bad and meta.get("skipped_steps", 0) > meta["step"]:
        bad.append(("skipped_steps", f"{meta['skipped_steps']} of {meta['step']} steps"))
    if not isinstance(data, dict):
        bad.append(("data", repr(data)))
    else:
        bad += [(f"data.{k}", repr(data.get(k))) for k in ("epoch", "batch") if not _count(data.get(k))]
        if data.get("world_size") != world:
            bad.append(("data.world_size", f"{data.get('world_size')!r} with world_size {world!r}"))
        if data.get("micro_batch_size") is not None and not _count(data["micro_batch_size"], 1):
            bad.append(("data.micro_batch_size", repr(data["micro_batch_size"])))
    if sched is not None and not isinstance(sched, dict):
        bad.append(("scheduler", repr(sched)))
    elif sched is not None:
        groups = len(sched["base_lrs"]) if _finite(sched.get("base_lrs")) else None
        bad += [(f"scheduler.{k}", repr(sched.get(k))) for k, ok in [
            ("base_lrs", groups), ("last_epoch", _count(sched.get("last_epoch"), -1)),
            ("_step_count", _count(sched.get("_step_count", 0))),
            ("_last_lr", "_last_lr" not in sched or _finite(sched["_last_lr"]) and len(sched["_last_lr"]) == groups),
            ("lr_lambdas", isinstance(sched.get("lr_lambdas"), list) and len(sched["lr_lambdas"]) == groups
             and all(x is None or isinstance(x, dict) for x in sched["lr_lambdas"]))] if not ok]
    if meta.get("loss_scaler") is not None and not isinstance(meta["loss_scaler"], dict):
        bad.append(("loss_scaler", repr(meta["loss_scaler"])))
    if bad:
        field, value = bad[0]
        raise ZerorunError(f"{where}: {field}: {value} is not what a save writes: edited by hand? refusing the "
                           "checkpoint")


def _confined(path: str, name: Any, want: Any) -> str:
    """The file ``name`` of ``zerorun.json``'s ``files`` inside the checkpoint folder ``path``: a plain name
    (no folder part, not ``.``/``..``) that is no symbolic link, as DCP's ``relative_path`` is (Note
    [Untrusted checkpoints] in safety.py), with an integer size and a SHA-256 text.

    Raises:
        ZerorunError: naming ``zerorun.json``'s field.
    """
    where = os.path.join(path, META)
    if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", "..") or "\0" in name:
        raise ZerorunError(f"{where}: files: {name!r} is not a file of the checkpoint folder: refusing the "
                           "checkpoint")
    if not (isinstance(want, dict) and isinstance(want.get("bytes"), int) and isinstance(want.get("sha256"), str)):
        raise ZerorunError(f"{where}: files[{name!r}]: expected {{bytes: an integer, sha256: a text}}, got {want!r}")
    file = os.path.join(path, name)
    if os.path.islink(file):
        raise ZerorunError(f"{file}: a symbolic link, not a file of the checkpoint folder: refusing the checkpoint")
    return file


def check_layout(meta: dict[str, Any], metadata: Any, where: str) -> None:
    """The model part of ``zerorun.json``'s layout agrees with itself and with DCP's metadata before anything
    is allocated from it: every parameter and buffer has a name and a shape of non-negative integers whose
    element count is the saved tensor's, and every state-dict entry names one of them.

    Raises:
        ZerorunError: one line naming ``where`` and the field.
    """
    layout = meta.get("layout")
    if not isinstance(layout, dict) or not isinstance(layout.get("params"), list) \
            or not isinstance(layout.get("buffers", {}), dict) or not isinstance(layout.get("state_dict"), list):
        raise ZerorunError(f"{where}: layout: not a zerorun checkpoint layout (params, buffers, state_dict)")
    saved = metadata.state_dict_metadata
    entries = [(f"layout.params[{i}]", p.get("name") if isinstance(p, dict) else None,
                p.get("shape") if isinstance(p, dict) else None, True) for i, p in enumerate(layout["params"])]
    entries += [(f"layout.buffers[{k!r}]", k, b.get("shape") if isinstance(b, dict) else None, False)
                for k, b in layout.get("buffers", {}).items()]
    names = set()
    for field, name, shape, flat in entries:
        if not isinstance(name, str):
            raise ZerorunError(f"{where}: {field}.name: expected a name, got {name!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                  for d in shape):
            raise ZerorunError(f"{where}: {field}.shape: expected a list of non-negative integers, got {shape!r}")
        numel = math.prod(shape)
        entry = saved.get(f"model/{name}")
        size = getattr(entry, "size", None)
        if numel and (size is None or math.prod(size) != numel):
            raise ZerorunError(f"{where}: {field}.shape {shape} ({numel} elements) does not match the saved "
                               f"tensor 'model/{name}' ({'absent' if size is None else list(size)})")
        names.add(name)
    for i, pair in enumerate(layout["state_dict"]):
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str) and pair[1] in names):
            raise ZerorunError(f"{where}: layout.state_dict[{i}]: expected [key, a saved name], got {pair!r}")


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
