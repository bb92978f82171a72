"""Sharded checkpoints (zerorun/checkpoint.py, zerorun/zero/state.py) on real gloo ranks.

The resumed runs build their model from another seed, so only what the checkpoint restores can make their
losses equal the uninterrupted run's.
"""

from __future__ import annotations

import os
import pickle
import shutil

import pytest
import torch
from safetensors.torch import load_file

import checkpoint_cases as cases
from parity_cases import _build, rel
from zerorun import checkpoint
from zerorun.errors import ZerorunError


@pytest.fixture(scope="module")
def saved3(ranks, tmp_path_factory):
    """3 ranks, stage 3, no dropout: saved after step 3, trained on to step 6."""
    root = str(tmp_path_factory.mktemp("ckpt3"))
    results = ranks(3).run(cases.save_and_continue, root=root, stage=3, save_at=3, steps=6)
    return results[0]


def test_resume_same_world_size_and_stage_is_exact(ranks, saved3):
    resumed = ranks(3).run(cases.resume_and_continue, path=saved3["path"], stage=3, steps=6)
    for r in resumed:
        assert r["step"] == 3 and r["position"] == (3, 5)
        assert r["losses"] == saved3["losses"]  # bit for bit


def test_resume_on_2_ranks_at_stage_1_is_resharded(ranks, saved3):
    """Saved on 3 ranks at stage 3, resumed on 2 ranks at stage 1 (same global batch): the same training."""
    for r in ranks(2).run(cases.resume_and_continue, path=saved3["path"], stage=1, steps=6):
        assert len(r["losses"]) == 3
        assert max(rel(a, b) for a, b in zip(r["losses"], saved3["losses"])) <= 1e-5, (r["losses"], saved3["losses"])


def test_resume_with_dropout_is_exact(ranks, tmp_path):
    """Stage 2 with dropout: every rank's RNG state is restored, so the dropout masks repeat."""
    saved = ranks(2).run(cases.save_and_continue, root=str(tmp_path), stage=2, save_at=2, steps=5, dropout=0.1)[0]
    for r in ranks(2).run(cases.resume_and_continue, path=saved["path"], stage=2, steps=5, dropout=0.1):
        assert r["losses"] == saved["losses"]


def test_stage_0_checkpoint_resumes_on_3_ranks_at_stage_2(ranks, tmp_path):
    """Stage 0 writes replicated tensors (once); 2 -> 3 ranks, stage 0 -> 2."""
    saved = ranks(2).run(cases.save_and_continue, root=str(tmp_path), stage=0, save_at=2, steps=4)[0]
    for r in ranks(3).run(cases.resume_and_continue, path=saved["path"], stage=2, steps=4):
        assert max(rel(a, b) for a, b in zip(r["losses"], saved["losses"])) <= 1e-5, (r["losses"], saved["losses"])


def test_frozen_parameters_and_buffers_move_from_stage_3_to_stage_1(ranks, tmp_path):
    """Frozen parameters are sharded at stage 3 and whole at stage 1; BatchNorm buffers are whole everywhere."""
    kwargs = dict(model="mlp", frozen=True, batchnorm=True)
    saved = ranks(3).run(cases.save_and_continue, root=str(tmp_path), stage=3, save_at=2, steps=4, **kwargs)[0]
    for r in ranks(3).run(cases.resume_and_continue, path=saved["path"], stage=1, steps=4, **kwargs):
        assert max(rel(a, b) for a, b in zip(r["losses"], saved["losses"])) <= 1e-5, (r["losses"], saved["losses"])


def test_consolidate_round_trip_equals_full_state_dict(saved3, tmp_path):
    full = saved3["full"]
    for name in ("model.safetensors", "model.pt"):
        out = str(tmp_path / name)
        count, nbytes = checkpoint.consolidate(saved3["path"], out)
        assert count == len(full) and nbytes == os.path.getsize(out)
        state = load_file(out) if name.endswith(".safetensors") else torch.load(out, weights_only=True)
        assert (sorted(state) == sorted(full)) if name.endswith(".safetensors") else (list(state) == list(full))
        for key in full:
            assert state[key].dtype == full[key].dtype and torch.equal(state[key], full[key]), key
        model = _build("gpt", 5)
        model.load_state_dict(state)  # strict: the unsharded model accepts it
    # a folder of checkpoints stands for its latest
    assert checkpoint.consolidate(os.path.dirname(saved3["path"]), str(tmp_path / "m.pt"))[0] == len(full)


def test_checkpoint_of_another_model_is_one_line_error(ranks, saved3):
    for message in ranks(2).run(cases.load_error, path=saved3["path"], tie_embeddings=False):
        assert message.startswith(os.path.join(saved3["path"], "zerorun.json") + ": another model: ")
        assert "'lm_head.weight'" in message and "\n" not in message


def test_keep_prunes_old_checkpoints(ranks, tmp_path):
    left = ranks(2).run(cases.save_every_step, root=str(tmp_path), stage=1, steps=3, keep=2)[0]
    assert left == ["step-00000002", "step-00000003"]
    assert checkpoint.latest(str(tmp_path)) == str(tmp_path / "step-00000003")


def _copy(saved3, tmp_path) -> str:
    path = str(tmp_path / "step-00000003")
    shutil.copytree(saved3["path"], path)
    return path


def test_truncated_file_names_file_and_key(saved3, tmp_path):
    path = _copy(saved3, tmp_path)
    data = os.path.join(path, "__1_0.distcp")
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    with pytest.raises(ZerorunError, match=r"__1_0\.distcp: truncated: \d+ bytes, key '(model|optim|rng)/[^']+' needs"):
        checkpoint.consolidate(path, str(tmp_path / "m.pt"))
    assert not os.path.exists(tmp_path / "m.pt")


def test_missing_and_half_written_checkpoints_are_errors(saved3, tmp_path):
    with pytest.raises(ZerorunError, match="no-such: no such checkpoint directory"):
        checkpoint.consolidate(str(tmp_path / "no-such"), str(tmp_path / "m.pt"))
    path = _copy(saved3, tmp_path)
    os.remove(os.path.join(path, checkpoint.MARKER))
    with pytest.raises(ZerorunError, match="not a complete checkpoint"):
        checkpoint.consolidate(path, str(tmp_path / "m.pt"))
    with pytest.raises(ZerorunError, match="no complete checkpoint in it"):
        checkpoint.resolve(str(tmp_path))
    with pytest.raises(ZerorunError, match=r"--out .*m\.bin: the file name must end in"):
        checkpoint.consolidate(saved3["path"], str(tmp_path / "m.bin"))


def test_latest_skips_half_written_checkpoints(tmp_path):
    """Only folders named step-N with a COMPLETE marker count; the most recently completed one wins."""
    for step, marked in ((2, True), (4, True), (6, False)):
        os.makedirs(tmp_path / f"step-{step:08d}")
        if marked:
            (tmp_path / f"step-{step:08d}" / checkpoint.MARKER).write_text(f'{{"step": {step}, "saved_at": {step}}}')
    os.makedirs(tmp_path / ".step-00000008.tmp")
    assert checkpoint.latest(str(tmp_path)) == str(tmp_path / "step-00000004")
    # a run resumed from step 2 re-saved step 2 after step 4 was written: step 2 is the latest now
    (tmp_path / "step-00000002" / checkpoint.MARKER).write_text('{"step": 2, "saved_at": 10}')
    assert checkpoint.latest(str(tmp_path)) == str(tmp_path / "step-00000002")


def test_metadata_is_not_unpickled_freely(saved3, tmp_path):
    path = _copy(saved3, tmp_path)

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(Evil(), f)
    with pytest.raises(ZerorunError, match=r"\.metadata: unreadable checkpoint metadata .*refusing to load"):
        checkpoint.consolidate(path, str(tmp_path / "m.pt"))
    assert not os.path.exists(tmp_path / "pwned")


def test_recipe_checkpoint_section(tmp_path):
    from zerorun.recipe import load_recipe

    tiny = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes/tiny.yaml")
    assert load_recipe(tiny).checkpoint.dir is None  # no section: no checkpoints
    r = load_recipe(tiny, ["checkpoint.every=5", f"log.dir={tmp_path}"])
    assert r.checkpoint.dir == str(tmp_path / "tiny" / "checkpoints") and r.checkpoint.keep == 2
    assert load_recipe(tiny, ["checkpoint.dir=ck"]).checkpoint.dir == os.path.abspath("ck")
    (tmp_path / "file").write_text("")
    with pytest.raises(ZerorunError, match=r"override 'checkpoint.dir=.*': checkpoint\.dir: not a directory"):
        load_recipe(tiny, [f"checkpoint.dir={tmp_path / 'file'}"])


def test_resume_takes_an_optional_path():
    from zerorun.cli import optional_value

    assert optional_value(["train", "r.yaml", "--resume"], "--resume", "latest") == ["train", "r.yaml", "--resume=latest"]
    assert optional_value(["train", "r.yaml", "--resume", "zero.stage=1"], "--resume", "latest")[2] == "--resume=latest"
    assert optional_value(["train", "r.yaml", "--resume", "--dry-run"], "--resume", "latest")[2] == "--resume=latest"
    assert optional_value(["train", "r.yaml", "--resume", "ck/step-3"], "--resume", "latest")[2:] == ["--resume", "ck/step-3"]
