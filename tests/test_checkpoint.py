"""Sharded checkpoints (zerorun/checkpoint/, zerorun/zero/state.py) on real gloo ranks.

The resumed runs build their model from another seed, so only what the checkpoint restores can make their
losses equal the uninterrupted run's.
"""

from __future__ import annotations

import math
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
    for name, umask in (("model.safetensors", 0o027), ("model.pt", 0o002)):
        out = str(tmp_path / name)
        old = os.umask(umask)
        try:
            count, nbytes = checkpoint.consolidate(saved3["path"], out)
        finally:
            os.umask(old)
        assert os.stat(out).st_mode & 0o777 == 0o666 & ~umask, oct(os.stat(out).st_mode)  # as open() makes files
        assert count == len(full) and nbytes == os.path.getsize(out)
        state = load_file(out) if name.endswith(".safetensors") else torch.load(out, weights_only=True)
        assert (sorted(state) == sorted(full)) if name.endswith(".safetensors") else (list(state) == list(full))
        for key in full:
            assert state[key].dtype == full[key].dtype and torch.equal(state[key], full[key]), key
        model = _build("gpt", 5)
        model.load_state_dict(state)  # strict: the unsharded model accepts it
    # a folder of checkpoints stands for its latest
    assert checkpoint.consolidate(os.path.dirname(saved3["path"]), str(tmp_path / "m.pt"))[0] == len(full)
    assert sorted(os.listdir(tmp_path)) == ["m.pt", "model.pt", "model.safetensors"]  # no temporary file left


def _assert_same_state(a: dict, b: dict) -> None:
    """Two :func:`checkpoint_cases.snapshot` s of one rank are equal bit for bit: fp32 master slices, every
    optimizer state tensor, the fp16 loss scaler and the skipped steps."""
    assert len(a["masters"]) == len(b["masters"]) and len(a["optim"]) == len(b["optim"])
    for x, y in zip(a["masters"], b["masters"]):
        assert x.dtype == y.dtype == torch.float32 and torch.equal(x, y)
    for x, y in zip(a["optim"], b["optim"]):
        assert sorted(x) == sorted(y) and x
        for key in x:
            assert torch.equal(x[key], y[key]), key
    assert a["scaler"] == b["scaler"] and a["skipped"] == b["skipped"]


# stage, extra ZeroConfig fields, save after, train to. fp16 starts at a scale whose gradients overflow
# (2**17 * the loss > fp16's 65504): steps 1-2 are skipped, step 4 grows the scale (growth_interval 2) and
# step 5 overflows again, so a resume that did not restore the scaler would skip other steps.
MIXED = {
    "bf16-stage2": (2, {"precision": "bf16"}, 3, 5),
    "bf16-stage3": (3, {"precision": "bf16"}, 3, 5),
    "fp16-stage2": (2, {"precision": "fp16", "loss_scale": {"initial_scale": 2.0 ** 17, "growth_interval": 2}}, 4, 6),
    "bf16-cpu-offload-stage2": (2, {"precision": "bf16", "offload_optimizer": "cpu"}, 3, 5),
    # a 1.5 KiB paging buffer: sub-groups of 64 elements, several per flat buffer slice
    "fp32-disk-offload-stage2": (2, {"offload_optimizer": "disk", "offload_buffer_mb": 0.0015}, 3, 5),
}


@pytest.mark.parametrize("case", list(MIXED))
def test_resume_is_exact_under_mixed_precision_and_offload(ranks, tmp_path, case):
    """Same world size and stage: the resumed run's losses, fp32 masters, optimizer states (wherever offload
    keeps them) and loss scaler equal the uninterrupted run's, right after the load and at the end."""
    stage, zero, save_at, steps = MIXED[case]
    if zero.get("offload_optimizer") == "disk":
        zero = dict(zero, offload_path=str(tmp_path / "swap"))
    saved = ranks(2).run(cases.save_and_continue, root=str(tmp_path / "ckpt"), stage=stage, save_at=save_at,
                         steps=steps, zero=zero)
    resumed = ranks(2).run(cases.resume_and_continue, path=saved[0]["path"], stage=stage, steps=steps, zero=zero)
    for s, r in zip(saved, resumed):
        assert r["step"] == save_at and r["losses"] == s["losses"]  # bit for bit
        _assert_same_state(r["loaded"], s["saved"])
        _assert_same_state(r["end"], s["end"])
    if "loss_scale" in zero:
        assert saved[0]["saved"]["skipped"] == 2 and saved[0]["saved"]["scaler"] == {"scale": 2.0 ** 16,
                                                                                      "good_steps": 0}
        assert saved[0]["end"]["skipped"] == 3
    if zero.get("offload_optimizer") == "disk":
        assert os.listdir(tmp_path / "swap") == [".zerorun-offload-lock"]  # swap files removed at close


def _sum_sq(snapshots: list[dict], key: str) -> float:
    """Sum of squares over every rank's fp32 master slices (``key="masters"``) or Adam ``exp_avg_sq`` slices
    (padding is zero in both)."""
    if key == "masters":
        return sum(float((m.double() ** 2).sum()) for s in snapshots for m in s["masters"])
    return sum(float((o[key].double() ** 2).sum()) for s in snapshots for o in s["optim"])


def test_bf16_stage_3_resumes_in_fp32_at_stage_1_from_the_fp32_masters(ranks, tmp_path):
    """Saved in bf16 at stage 3, resumed in fp32 at stage 1: the parameters are the saved fp32 masters (not
    their bf16 roundings), and masters and optimizer states carry over whole."""
    saved = ranks(2).run(cases.save_and_continue, root=str(tmp_path / "ckpt"), stage=3, save_at=3, steps=3,
                         zero={"precision": "bf16"})
    resumed = ranks(2).run(cases.resume_and_continue, path=saved[0]["path"], stage=1, steps=5)
    checkpoint.consolidate(saved[0]["path"], str(tmp_path / "m.safetensors"))
    masters = load_file(str(tmp_path / "m.safetensors"))
    params = resumed[0]["params"]
    assert sorted(params) == sorted(masters)
    for key, value in masters.items():
        assert params[key].dtype == torch.float32 and torch.equal(params[key], value), key
    assert any(not torch.equal(v, v.to(torch.bfloat16).float()) for v in masters.values())
    for key in ("masters", "exp_avg", "exp_avg_sq"):
        assert rel(_sum_sq([r["loaded"] for r in resumed], key), _sum_sq([s["saved"] for s in saved], key)) <= 1e-12
    assert all(len(r["losses"]) == 2 and all(map(math.isfinite, r["losses"])) for r in resumed)


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


def test_corrupted_file_of_the_same_size_is_refused(saved3, tmp_path):
    """Bytes flipped inside a data file used to load silently (consolidate wrote values like 853.39; a resume
    trained on from them): every file's SHA-256 is kept in zerorun.json and checked before loading."""
    path = _copy(saved3, tmp_path)
    data = os.path.join(path, "__0_0.distcp")
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) // 2)
        block = f.read(64)
        f.seek(os.path.getsize(data) // 2)
        f.write(bytes(b ^ 0xFF for b in block))
    with pytest.raises(ZerorunError, match=r"__0_0\.distcp: changed since it was saved .*corrupted or truncated"):
        checkpoint.consolidate(path, str(tmp_path / "m.pt"))
    assert not os.path.exists(tmp_path / "m.pt")
    os.remove(os.path.join(path, "__1_0.distcp"))
    with pytest.raises(ZerorunError, match=r"__1_0\.distcp: missing"):
        checkpoint.check(path)


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
    with pytest.raises(ZerorunError, match=r"checkpoint: checkpoints are zerorun's .* the ddp baseline does not save"):
        load_recipe(tiny, ["checkpoint.every=5", "runtime=ddp"])


def test_bench_jobs_save_no_checkpoints():
    """``zerorun bench`` runs many jobs from one recipe: none of them saves (or times) checkpoints."""
    from zerorun.bench import Combination
    from zerorun.recipe import load_recipe

    tiny = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes/tiny.yaml")
    for combo in (Combination(None, "zero", 2), Combination(None, "ddp")):
        r = load_recipe(tiny, ["checkpoint.every=5", "checkpoint.dir=ck", *combo.overrides(9)])
        assert r.checkpoint.dir is None and r.checkpoint.every == 0


def test_resume_takes_an_optional_path(tmp_path):
    from zerorun.cli import optional_value

    assert optional_value(["train", "r.yaml", "--resume"], "--resume", "latest") == ["train", "r.yaml",
                                                                                      "--resume=latest"]
    assert optional_value(["train", "r.yaml", "--resume", "zero.stage=1"], "--resume", "latest")[2] == "--resume=latest"
    assert optional_value(["train", "r.yaml", "--resume", "--dry-run"], "--resume", "latest")[2] == "--resume=latest"
    assert optional_value(["train", "r.yaml", "--resume", "ck/step-3"], "--resume", "latest")[2:] == ["--resume",
                                                                                                      "ck/step-3"]
    # before the recipe: the recipe is not the checkpoint (a new user's review: "Missing argument 'RECIPE'")
    assert optional_value(["train", "--resume", "r.yaml"], "--resume", "latest") == ["train", "--resume=latest",
                                                                                      "r.yaml"]
    assert optional_value(["train", "--resume", "R.YML"], "--resume", "latest")[1] == "--resume=latest"
    # a checkpoint folder whose name ends in .yml stays the value (a review)
    (tmp_path / "ck.yml").mkdir()
    assert optional_value(["train", "r.yaml", "--resume", str(tmp_path / "ck.yml")], "--resume", "latest")[2] == \
        "--resume"


def test_library_save_and_load_take_optional_arguments_and_refuse_bad_ones(ranks, tmp_path):
    """Found by review of the library path: ``scheduler=None`` raised AttributeError, ``recipe={}`` KeyError,
    a recipe or scheduler state that is not JSON-able TypeError, ``step=-1`` made ``step--0000001``; each left
    its ``.step-N.<job>.tmp`` folder behind. Now the arguments are optional or refused in one line on every
    rank before anything is written, and a scheduler given to ``load`` must match the checkpoint's."""
    root = tmp_path / "ckpt"
    got = ranks(2).run(cases.library_arguments, root=str(root))
    for rank, r in enumerate(got):
        assert r["step=-1"] == "ZerorunError: checkpoint.save: step: expected a whole number >= 0, got -1"
        assert r["step=2.0"] == "ZerorunError: checkpoint.save: step: expected a whole number >= 0, got 2.0"
        assert r["keep=-1"].startswith("ZerorunError: checkpoint.save: keep: expected a whole number >= 0")
        assert r["recipe"] == ("ZerorunError: checkpoint.save: recipe['train']['collate'][1]: object is not "
                               "JSON-able (expected JSON-able data or None)")
        assert r["scheduler"] == ("ZerorunError: checkpoint.save: scheduler.state_dict()['fn']: object is not "
                                  "JSON-able: zerorun.json cannot hold this scheduler")
        assert r["position"].startswith("ZerorunError: checkpoint.save: position: expected a DataPosition")
        assert r["rank 1's step"] == ("ZerorunError: checkpoint.save: step: expected a whole number >= 0, got -1"
                                      if rank else "ZerorunError: checkpoint.save: rank 1 was given an argument "
                                      "it refused (its error names it): every rank must pass the same; nothing "
                                      "was done")
        # found by a review: steps that differ (each valid) left a step folder marked complete without rank 1's
        # shards; a scheduler raising on one rank, or a load argument refused on one rank, hung the others
        assert r["steps differ"] == (f"ZerorunError: checkpoint.save: the ranks were given different values of step "
                                     f"(this rank: {1 + rank}): every rank must pass the same; nothing was done")
        assert r["rank 1's scheduler raises"] == (
            "ZerorunError: checkpoint.save: RuntimeError: scheduler state unavailable" if rank else
            "ZerorunError: checkpoint.save: rank 1 was given an argument it refused (its error names it): every "
            "rank must pass the same; nothing was done")
        assert r["load: rank 0's scheduler"] == (
            "ZerorunError: checkpoint.load: rank 0 was given an argument it refused (its error names it): every "
            "rank must pass the same; nothing was done" if rank else
            f"ZerorunError: {root / 'step-00000001' / 'zerorun.json'}: saved without a scheduler: load it with "
            "scheduler=None")
        assert r["left"] == [], r["left"]  # nothing written: not even the folder
        assert r["bare"] == ("ok", str(root / "step-00000001")) and r["scheduled"][0] == "ok"
        assert r["load bare"] == ("ok", (1, (0, 0))) and r["load scheduled"] == ("ok", (2, (0, 0)))
        assert r["load bare with a scheduler"] == (f"ZerorunError: {root / 'step-00000001' / 'zerorun.json'}: "
                                                   "saved without a scheduler: load it with scheduler=None")
        assert r["load scheduled without one"] == (f"ZerorunError: {root / 'step-00000002' / 'zerorun.json'}: "
                                                   "holds a scheduler's state: pass the scheduler (scheduler=...) "
                                                   "to restore it")
        assert r["load micro_batch_size=0"] == ("ZerorunError: checkpoint.load: micro_batch_size: expected a whole "
                                                "number > 0 or None, got 0")
    meta = checkpoint.read_meta(str(root / "step-00000001"))
    assert meta["scheduler"] is None and meta["recipe"] is None and meta["data"]["micro_batch_size"] is None
    # zerorun train refuses it before launching (found by review: the ranks refused it, with a script's hint)
    from test_train_e2e import TINY
    from zerorun.checkpoint.resume import prepare_resume
    from zerorun.recipe import load_recipe

    with pytest.raises(ZerorunError) as e:
        prepare_resume(load_recipe(TINY, [f"log.dir={tmp_path}"]), str(root / "step-00000001"))
    assert str(e.value) == (f"{root / 'step-00000001' / 'zerorun.json'}: saved without an LR scheduler (by a script "
                            "of your own?): zerorun train resumes checkpoints saved with one")
    assert sorted(os.listdir(root)) == ["step-00000001", "step-00000002"]  # keep=0 (the default) keeps every one


def test_a_folder_that_is_no_checkpoint_is_named_so(tmp_path):
    """Found by review: the root of checkpoints, an empty folder or one of other files was "not a complete
    checkpoint (no COMPLETE marker: its save did not finish)", though no save ever ran there."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(ZerorunError, match=r"^.*empty: not a checkpoint \(no zerorun.json, .metadata or .distcp file"):
        checkpoint.check(str(tmp_path / "empty"))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("x")
    with pytest.raises(ZerorunError, match=r"other: not a checkpoint \("):
        checkpoint.check(str(tmp_path / "other"))
    root = tmp_path / "ckpt"
    for step in (2, 4, 6):
        os.makedirs(root / f"step-{step:08d}")
        if step < 6:
            (root / f"step-{step:08d}" / checkpoint.MARKER).write_text(f'{{"step": {step}, "saved_at": {step}}}')
    with pytest.raises(ZerorunError) as e:
        checkpoint.check(str(root))
    assert str(e.value) == (f"{root}: a folder of checkpoints, not a checkpoint: pass one of its step-N folders, "
                            f"e.g. the newest complete one, {root / 'step-00000004'}")
    half = root / "step-00000006"
    (half / ".metadata").write_text("")
    with pytest.raises(ZerorunError, match=r"step-00000006: not a complete checkpoint \(no COMPLETE marker: its save"):
        checkpoint.check(str(half))
    assert checkpoint.resolve(str(root)) == str(root / "step-00000004")  # --resume ROOT and consolidate: its latest


def test_the_library_example_of_the_docs_runs(ranks, tmp_path):
    """docs/checkpoints.md's "From your own script" example, as written, on 2 ranks."""
    page = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "checkpoints.md")
    for r in ranks(2).run(cases.run_docs_snippet, page=page, heading="## From your own script", cwd=str(tmp_path)):
        assert r == {"step": 5, "position": checkpoint.DataPosition(0, 0), "path": "checkpoints/step-00000005",
                     "last_epoch": 10}, r
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-00000005"]
    assert checkpoint.check(str(tmp_path / "checkpoints" / "step-00000005"))["scheduler"]["last_epoch"] == 5


@pytest.mark.parametrize("stage,load_stage", [(0, 0), (2, 3), (3, 3)])
def test_module_buffers_that_differ_by_rank_load_as_rank_0s(ranks, tmp_path, stage, load_stage):
    """Note [Checkpoint layout] (found by review): BatchNorm running statistics differ by rank after a step on
    each rank's batch; every rank offered its own to DCP, which wrote each from a rank of its choosing, so a load
    brought back a mix (a running mean from rank 1, a running variance from rank 0). They load as rank 0's."""
    for rank, r in enumerate(ranks(2).run(cases.buffers_after_load, root=str(tmp_path), stage=stage,
                                          load_stage=load_stage)):
        assert r["rank0"] and len(r["keys"]) == 4, f"rank {rank}: {r}"
