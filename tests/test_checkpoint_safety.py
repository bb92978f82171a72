"""Checkpoint folders are input (Note [Untrusted checkpoints] in zerorun/checkpoint/safety.py): a folder written by
someone else must never run code, and loading must fill every target or fail in one line."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys

import pytest
import torch

import checkpoint_cases as cases
from zerorun import checkpoint
from zerorun.checkpoint.safety import why_not_written
from zerorun.errors import ZerorunError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def saved2(ranks, tmp_path_factory):
    """A real checkpoint: 2 ranks, stage 1, GPT of checkpoint_cases, saved after step 1."""
    root = str(tmp_path_factory.mktemp("ckpt2"))
    return ranks(2).run(cases.save_and_continue, root=root, stage=1, save_at=1, steps=1)[0]["path"]


def _rewrite(path: str, edit) -> None:
    """Apply ``edit(metadata)`` to the folder's ``.metadata`` and re-write zerorun.json's SHA-256 list as an
    attacker who writes the folder would."""
    meta_file = os.path.join(path, ".metadata")
    with open(meta_file, "rb") as f:
        metadata = pickle.load(f)  # our own file, written by DCP a moment ago
    edit(metadata)
    with open(meta_file, "wb") as f:
        pickle.dump(metadata, f)
    info = json.loads(open(os.path.join(path, checkpoint.META)).read())
    info["files"] = {n: {"bytes": os.path.getsize(os.path.join(path, n)),
                         "sha256": hashlib.sha256(open(os.path.join(path, n), "rb").read()).hexdigest()}
                     for n in sorted(os.listdir(path)) if n not in (checkpoint.META, checkpoint.MARKER)}
    with open(os.path.join(path, checkpoint.META), "w") as f:
        json.dump(info, f)
    _reseal(path)


def _reseal(path: str) -> None:
    """The ``COMPLETE`` marker's SHA-256 of zerorun.json made that of the file as it is now (an attacker's edit)."""
    marker = os.path.join(path, checkpoint.MARKER)
    sealed = json.loads(open(marker).read())
    sealed["sha256"] = hashlib.sha256(open(os.path.join(path, checkpoint.META), "rb").read()).hexdigest()
    with open(marker, "w") as f:
        json.dump(sealed, f)


class _Payload:
    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def _malicious(saved: str, tmp_path, victim: str = "model/") -> tuple[str, str]:
    """A copy of ``saved`` whose first ``victim*`` key is a DCP BytesStorageMetadata entry holding a pickle
    that creates a file when unpickled (what torch's default planner does, with weights_only=False).
    Returns ``(folder, the file the payload would create)``."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    path = str(tmp_path / "step-00000001")
    shutil.copytree(saved, path)
    pwned = str(tmp_path / "pwned")
    torch.save(_Payload(pwned), os.path.join(path, "__9_0.distcp"))

    def edit(metadata):
        key = next(k for k in metadata.state_dict_metadata if k.startswith(victim))
        metadata.state_dict_metadata[key] = BytesStorageMetadata()
        for index in [i for i in metadata.storage_data if i.fqn == key]:
            del metadata.storage_data[index]
        metadata.storage_data[MetadataIndex(key)] = _StorageInfo(
            "__9_0.distcp", 0, os.path.getsize(os.path.join(path, "__9_0.distcp")))

    _rewrite(path, edit)
    return path, pwned


def _zerorun(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerorun", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_payload_would_run_under_torchs_default_planner(tmp_path):
    """The test's payload is real: torch.load(weights_only=False), as DCP's default planner calls it, runs it."""
    torch.save(_Payload(str(tmp_path / "ran")), tmp_path / "p.pt")
    torch.load(tmp_path / "p.pt", weights_only=False)
    assert os.path.exists(tmp_path / "ran")


def test_non_tensor_entry_is_refused_before_any_read(ranks, saved2, tmp_path):
    path, pwned = _malicious(saved2, tmp_path)
    refused = r"\.metadata: key 'model/[^']+' holds a BytesStorageMetadata, not a tensor: .*refusing the checkpoint"
    with pytest.raises(ZerorunError, match=refused):
        checkpoint.consolidate(path, str(tmp_path / "m.pt"))
    errors = ranks(2).run(cases.load_error, path=path)  # resume on the ranks, same model
    assert all(e.count("\n") == 0 and "BytesStorageMetadata, not a tensor" in e for e in errors), errors
    out = _zerorun("consolidate", path, "--out", str(tmp_path / "m.safetensors"))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "BytesStorageMetadata, not a tensor" in out.stderr
    out = _zerorun("train", "recipes/tiny.yaml", f"log.dir={tmp_path / 'runs'}", "--resume", path)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stdout + out.stderr
    assert "BytesStorageMetadata, not a tensor" in out.stderr
    assert not os.path.exists(pwned)
    assert not os.path.exists(tmp_path / "m.pt") and not os.path.exists(tmp_path / "m.safetensors")


def test_planner_never_unpickles_and_checks_every_target_was_written(saved2, tmp_path):
    """Even past the metadata check (a plain reader), the planner refuses bytes entries; a key whose chunks
    were dropped from the metadata leaves its target unwritten: named, not resumed silently."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException

    from zerorun.checkpoint.safety import SafeLoadPlanner

    os.makedirs(tmp_path / "a")
    path, pwned = _malicious(saved2, tmp_path / "a")
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)
    key = next(k for k, v in md.state_dict_metadata.items() if type(v).__name__ == "BytesStorageMetadata")
    with pytest.raises(CheckpointException, match="refusing to unpickle"):
        dcp.load({key: torch.empty(1)}, storage_reader=FileSystemReader(path), planner=SafeLoadPlanner(),
                 no_dist=True)
    assert not os.path.exists(pwned)

    path = str(tmp_path / "step-00000001")  # saved2 is step 1's checkpoint
    shutil.copytree(saved2, path)
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)
    key, entry = next((k, v) for k, v in md.state_dict_metadata.items() if len(v.chunks) > 1)
    dropped = entry.chunks.pop()
    _rewrite(path, lambda m: m.state_dict_metadata[key].chunks.remove(dropped))
    with pytest.raises(ZerorunError, match=rf"key '{key}': its chunks do not cover it"):
        checkpoint.consolidate(path, str(tmp_path / "m.pt"))
    planner = SafeLoadPlanner()
    target = torch.zeros(entry.size)
    dcp.load({key: target}, storage_reader=FileSystemReader(path), planner=planner, no_dist=True)
    assert planner.unwritten() == f"{key!r} ({target.numel() - dropped.sizes[0]} of {target.numel()} elements read)"


@pytest.mark.parametrize("edit,expected", [
    (lambda m, k: setattr(next(iter(m.storage_data.values())), "relative_path", "../../x.distcp"),
     "not a data file of the checkpoint folder"),
    (lambda m, k: setattr(next(iter(m.storage_data.values())), "transform_descriptors", ["zstd"]),
     "stored with transforms"),
    (lambda m, k: m.state_dict_metadata[k].chunks.append(m.state_dict_metadata[k].chunks[0]), "its chunks overlap"),
])
def test_metadata_that_zerorun_never_writes_is_refused(saved2, tmp_path, edit, expected):
    path = str(tmp_path / "step-00000001")
    shutil.copytree(saved2, path)
    with open(os.path.join(path, ".metadata"), "rb") as f:
        key = next(k for k, v in pickle.load(f).state_dict_metadata.items() if len(v.chunks) > 1)
    _rewrite(path, lambda m: edit(m, key))
    with pytest.raises(ZerorunError, match=expected):
        checkpoint.check(path)


def test_launch_env_values_are_masked_in_the_checkpoint(ranks, tmp_path):
    import safety_cases
    from zerorun.recipe import MASK

    path = ranks(2).run(safety_cases.save_with_env, root=str(tmp_path), env={"HF_TOKEN": "hf_s3cr3t_value"})[0]
    meta = checkpoint.read_meta(path)
    assert meta["recipe"]["launch"]["env"] == {"HF_TOKEN": MASK}
    for name in os.listdir(path):
        assert b"hf_s3cr3t_value" not in open(os.path.join(path, name), "rb").read(), name


def test_save_that_runs_out_of_room_says_where_and_why(ranks, tmp_path):
    """A file-size limit (EFBIG) during DCP's write and a full disk (ENOSPC) while rank 0 finishes: one line
    naming the folder and the reason on every rank, no hang, nothing half-written left to be taken as a
    checkpoint, the earlier complete save of the same step back in place."""
    import safety_cases

    root = tmp_path / "ckpt"
    results = ranks(2).run(safety_cases.failing_saves, root=str(root), fsize_limit=16 * 1024)
    r0 = results[0]
    assert r0["first"] is None
    tmp2 = re.escape(str(root / ".step-00000002.")) + r"p\d+\.tmp"  # no launcher: rank 0's pid names the save
    assert re.match(rf"checkpoint.dir: cannot save step 2 into {tmp2}: File too large", r0["fsize"]), r0["fsize"]
    assert "\n" not in r0["fsize"] and "CheckpointException" not in r0["fsize"]
    assert results[1]["fsize"] == r0["fsize"]
    assert r0["after_fsize"] == ["step-00000001"] and r0["latest_after_fsize"] == str(root / "step-00000001")
    assert re.fullmatch(re.escape(f"checkpoint.dir: cannot save step 1 into {root / '.step-00000001.'}") + r"p\d+"
                        + re.escape(f".tmp: No space left on device ({root / 'step-00000001' / checkpoint.MARKER})"),
                        r0["enospc"]), r0["enospc"]
    assert results[1]["enospc"].endswith("failed on rank 0")
    assert r0["after_enospc"] == ["step-00000001"]  # the first save of step 1, complete, back in place
    assert r0["latest_after_enospc"] == str(root / "step-00000001") and r0["check_after_enospc"] == 1


def test_short_write_reported_by_torch_is_explained(tmp_path, monkeypatch):
    """torch's zip writer turns a write cut short by the file-size limit or a full disk into "unexpected pos"
    (seen with `prlimit --fsize=60000 zerorun train recipes/tiny.yaml checkpoint.every=1`): the reason is
    found on the host instead."""
    import resource
    from types import SimpleNamespace

    from torch.distributed.checkpoint.api import CheckpointException

    opaque = CheckpointException("ranks", {1: (RuntimeError("[enforce fail at inline_container.cc:672] . "
                                                            "unexpected pos 704 vs 598"), None)})
    (tmp_path / "__1_0.distcp").write_bytes(b"x" * 4096)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        why = why_not_written(opaque, str(tmp_path))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert why == "File too large (the file-size limit, ulimit -f, is 4096 bytes)"
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_bavail=3, f_frsize=4096))
    assert why_not_written(opaque, str(tmp_path)) == "No space left on device (12288 bytes free)"


@pytest.mark.parametrize("shape,expected", [
    ([1000000000000], r"layout\.params\[0\]\.shape \[1000000000000\] \(1000000000000 elements\) does not match"),
    (["a"], r"layout\.params\[0\]\.shape: expected a list of non-negative integers, got \['a'\]"),
    ([-5], r"layout\.params\[0\]\.shape: expected a list of non-negative integers, got \[-5\]"),
    (None, r"layout\.params\[0\]\.shape: expected a list of non-negative integers, got None"),
    ([True, 2], r"layout\.params\[0\]\.shape: expected a list of non-negative integers"),
])
def test_layout_that_disagrees_with_the_saved_tensors_is_one_line(saved2, tmp_path, shape, expected):
    """zerorun.json is written by whoever wrote the folder too: its layout is checked against itself and
    DCP's metadata before anything is allocated from it (a 4 TB allocation or a TypeError before)."""
    path = str(tmp_path / "step-00000001")
    shutil.copytree(saved2, path)
    info = json.loads(open(os.path.join(path, checkpoint.META)).read())
    info["layout"]["params"][0]["shape"] = shape
    with open(os.path.join(path, checkpoint.META), "w") as f:
        json.dump(info, f)
    _reseal(path)
    with pytest.raises(ZerorunError, match=r"zerorun\.json: " + expected) as e:
        checkpoint.consolidate(path, str(tmp_path / "m.safetensors"))
    assert "\n" not in str(e.value) and not os.path.exists(tmp_path / "m.safetensors")


def _files_entry(path: str, name: str, target: str) -> None:
    """Add ``name`` to zerorun.json's ``files`` with ``target``'s true size and SHA-256 (an attacker's list that
    the old check took, reading ``target`` wherever it is)."""
    info = json.loads(open(os.path.join(path, checkpoint.META)).read())
    data = open(target, "rb").read()
    info["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    with open(os.path.join(path, checkpoint.META), "w") as f:
        json.dump(info, f)
    _reseal(path)


@pytest.mark.parametrize("name", ["ABS", "../outside", "../../../../../../../../..ABS", "sub/inside", "..", "."])
def test_files_names_outside_the_folder_are_refused(saved2, tmp_path, name):
    """zerorun.json's ``files`` names are confined to the checkpoint folder, as DCP's relative_path is: a name
    with a folder part (absolute, ``..``, a subfolder) is refused in one line, never opened."""
    path = str(tmp_path / "c" / "step-00000001")
    shutil.copytree(saved2, path)
    outside = tmp_path / "c" / "outside"
    outside.write_text("not the checkpoint's\n")
    os.makedirs(os.path.join(path, "sub"))
    shutil.copy(outside, os.path.join(path, "sub", "inside"))
    name = name.replace("ABS", str(outside))
    target = os.path.normpath(os.path.join(path, name))
    _files_entry(path, name, target if os.path.isfile(target) else str(outside))
    with pytest.raises(ZerorunError, match=r"zerorun\.json: files: .* is not a file of the checkpoint folder") as e:
        checkpoint.check(path)
    assert "\n" not in str(e.value)


def test_files_entry_that_is_a_symlink_out_of_the_folder_is_refused(saved2, tmp_path):
    path = str(tmp_path / "step-00000001")
    shutil.copytree(saved2, path)
    (tmp_path / "secret").write_text("elsewhere\n")
    os.symlink(tmp_path / "secret", os.path.join(path, "notes"))
    _files_entry(path, "notes", str(tmp_path / "secret"))
    with pytest.raises(ZerorunError, match=r"notes: a symbolic link, not a file of the checkpoint folder"):
        checkpoint.check(path)


def test_data_file_that_is_a_symlink_is_refused(saved2, tmp_path):
    """DCP's data files too (named by relative_path, which may be left out of zerorun.json's files)."""
    path = str(tmp_path / "step-00000001")
    shutil.copytree(saved2, path)
    data = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))[0]
    shutil.move(os.path.join(path, data), tmp_path / "elsewhere.distcp")
    os.symlink(tmp_path / "elsewhere.distcp", os.path.join(path, data))
    with pytest.raises(ZerorunError, match=rf"{data}: a symbolic link, not a data file of the checkpoint folder"):
        checkpoint.check(path)


def test_shard_holding_a_pickle_is_named_by_file_and_key(ranks, saved2, tmp_path):
    """A tensor entry whose data is a pickle (not tensor bytes): torch.load(weights_only=True) refuses it; the
    error names the data file and the key (consolidate said only "CheckpointException ranks:dict_keys([0])"),
    the same on every rank for a resume, and nothing runs."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    path = str(tmp_path / "step-00000001")
    shutil.copytree(saved2, path)
    pwned = str(tmp_path / "pwned")
    torch.save(_Payload(pwned), os.path.join(path, "__9_0.distcp"))
    size = os.path.getsize(os.path.join(path, "__9_0.distcp"))
    victim = {}

    def edit(metadata):
        index = next(i for i in metadata.storage_data if i.fqn.startswith("model/"))
        metadata.storage_data[index] = _StorageInfo("__9_0.distcp", 0, size)
        victim["key"] = index.fqn

    _rewrite(path, edit)
    expected = (f"{path}: cannot read the checkpoint: {os.path.join(path, '__9_0.distcp')}: key {victim['key']!r}: "
                "not tensor data: refusing to unpickle it")
    with pytest.raises(ZerorunError) as e:
        checkpoint.consolidate(path, str(tmp_path / "m.pt"))
    assert str(e.value).startswith(expected) and "\n" not in str(e.value), str(e.value)
    out = _zerorun("consolidate", path, "--out", str(tmp_path / "m.safetensors"))
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0 and expected in out.stderr, out.stderr
    errors = ranks(2).run(cases.load_error, path=path)
    assert all(err.startswith(expected) and "\n" not in err for err in errors), errors
    assert not os.path.exists(pwned)


def test_a_save_leaves_another_jobs_save_folders(ranks, tmp_path):
    """A save removes only its own job's leftovers (Note [Checkpoint folder lock]): another job's folder being
    written in the same checkpoint.dir is left alone (every `.*.tmp` was removed, the other job then failed)."""
    import safety_cases

    others = [".step-00000001.0123456789ab.tmp", ".step-00000001.0123456789ab.old.tmp"]
    left = ranks(2).run(safety_cases.save_beside_another_job, root=str(tmp_path), others=others)[0]
    assert left == sorted(others) + ["step-00000001"], left


def test_a_save_that_rank_0_cannot_finish_for_another_reason_raises_on_every_rank(ranks, tmp_path):
    """Rank 0 fails while finishing a save with an error that is no disk's, after DCP's save returned: every rank
    raises one line, rank 0's naming the error, the others rank 0 (found by review: they waited for rank 0
    forever), and the save's folder is removed (found by review: a library caller's bad recipe left it)."""
    import checkpoint_cases

    root = tmp_path / "ckpt"
    got = ranks(2).run(checkpoint_cases.save_that_rank_0_cannot_finish, root=str(root))
    tmp = re.escape(str(root / ".step-00000001.")) + r"p\d+\.tmp"
    assert re.fullmatch(rf"ZerorunError: checkpoint.dir: cannot save step 1 into {tmp}: RuntimeError: meta broke",
                        got[0]["raised"]), got
    assert re.fullmatch(rf"ZerorunError: checkpoint.dir: cannot save step 1 into {tmp}: failed on rank 0",
                        got[1]["raised"]), got
    assert got[0]["left"] == got[1]["left"] == [], got
