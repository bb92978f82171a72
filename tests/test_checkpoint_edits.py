"""Hand-edited checkpoints: every file DCP reads is listed in ``zerorun.json`` with its SHA-256, the ``COMPLETE``
marker seals ``zerorun.json``'s own, and the fields the ranks read are checked in one line before any rank reads
them (``zerorun/checkpoint/files.py``; the files as untrusted input: tests/test_checkpoint_safety.py)."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest

import checkpoint_cases as cases
from test_checkpoint_safety import _reseal
from zerorun import checkpoint
from zerorun.errors import ZerorunError


@pytest.fixture(scope="module")
def saved2(ranks, tmp_path_factory):
    """A real checkpoint: 2 ranks, stage 1, GPT of checkpoint_cases, saved after step 1."""
    root = str(tmp_path_factory.mktemp("ckpt2"))
    return ranks(2).run(cases.save_and_continue, root=root, stage=1, save_at=1, steps=1)[0]["path"]


@pytest.mark.parametrize("drop", ["__0_0.distcp", ".metadata", "the list"])
def test_a_file_left_out_of_the_list_is_not_loaded_unchecked(saved2, tmp_path, drop):
    """Found by review: a file's entry (or the whole list) taken out of zerorun.json turned its check off, and a
    corrupted shard loaded silently."""
    path = str(tmp_path / "step-00000001")
    shutil.copytree(saved2, path)
    meta_path = os.path.join(path, checkpoint.META)
    meta = json.load(open(meta_path))
    if drop == "the list":
        del meta["files"]
    else:
        del meta["files"][drop]
    json.dump(meta, open(meta_path, "w"))
    marker = os.path.join(path, checkpoint.MARKER)
    with pytest.raises(ZerorunError, match=rf"^{re.escape(meta_path)}: changed since it was saved \(its SHA-256 "
                                           r"differs from the COMPLETE marker's\): edited by hand\? refusing"):
        checkpoint.check(path)
    json.dump({k: v for k, v in json.load(open(marker)).items() if k != "sha256"}, open(marker, "w"))  # an older one
    expected = (r"files: expected a mapping of file names, got None" if drop == "the list" else
                rf"files: {re.escape(drop)} is not listed \(a checkpoint lists every file it was saved with, with its "
                r"size and SHA-256\): edited by hand\? refusing it")
    with pytest.raises(ZerorunError, match=rf"^{re.escape(meta_path)}: {expected}$"):
        checkpoint.consolidate(path, str(tmp_path / "m.pt"))
    assert not os.path.exists(tmp_path / "m.pt")


@pytest.mark.parametrize("field,value,expected", [
    ("data.batch", -5, "data.batch: -5"),
    ("data.epoch", "1", "data.epoch: '1'"),
    ("data.micro_batch_size", 0, "data.micro_batch_size: 0"),
    ("data", None, "data: None"),
    ("scheduler.last_epoch", "abc", "scheduler.last_epoch: 'abc'"),
    ("scheduler.base_lrs", ["x"], "scheduler.base_lrs: \\['x'\\]"),
    ("scheduler", [], "scheduler: \\[\\]"),
    ("skipped_steps", 1.5, "skipped_steps: 1.5"),
    ("loss_scaler", 3, "loss_scaler: 3"),
    ("world_size+data.world_size", 7, "world_size: 7 with the RNG states of 2 ranks"),
    ("world_size+data.world_size", 1, "world_size: 1 with the RNG states of 2 ranks"),
    ("skipped_steps", 10**40, f"skipped_steps: {10**40} of 1 steps"),
    ("scheduler", {}, "scheduler.base_lrs: None"),
    ("scheduler.base_lrs", [float("nan"), 0.003], "scheduler.base_lrs: \\[nan, 0.003\\]"),
    ("scheduler.base_lrs", [0.003], "scheduler._last_lr: "),
    ("scheduler.lr_lambdas", ["x", "y"], "scheduler.lr_lambdas: \\['x', 'y'\\]"),
    ("scheduler._step_count", -1, "scheduler._step_count: -1"),
    ("data.world_size", 3, "data.world_size: 3 with world_size 2"),
    ("world_size", 0, "world_size: 0"),
])
def test_hand_edited_fields_are_one_line_before_any_rank_reads_them(saved2, tmp_path, field, value, expected):
    """Found by review: zerorun.json's data position, scheduler state and world size, edited (and the marker's
    SHA-256 of it made to match), reached the ranks: a traceback inside a rank's data loader or scheduler after
    "resumed from", or a silently different data position."""
    path = str(tmp_path / "step-00000001")
    shutil.copytree(saved2, path)
    info = json.loads(open(os.path.join(path, checkpoint.META)).read())
    for name in field.split("+"):
        *outer, last = name.split(".")
        holder = info
        for key in outer:
            holder = holder[key]
        holder[last] = value
    with open(os.path.join(path, checkpoint.META), "w") as f:
        json.dump(info, f)
    _reseal(path)
    with pytest.raises(ZerorunError, match=rf"^{re.escape(os.path.join(path, checkpoint.META))}: {expected}.* is not "
                                           r"what a save writes: edited by hand\? refusing the checkpoint$"):
        checkpoint.check(path)
