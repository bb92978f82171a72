"""zerorun import-deepspeed, what a review found passed over: the LR DeepSpeed trains at (its schedulers' defaults,
no scheduler at all), ``enabled`` as DeepSpeed reads it, Hjson configs, and the batch size and placeholders."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from zerorun.errors import ZerorunError
from zerorun.hf.deepspeed import import_deepspeed
from zerorun.recipe import Recipe
from zerorun.rank.schedule import lr_multiplier

from test_import_deepspeed import _run


def _lrs(data) -> list[float]:
    """The LR of each optimizer step of the imported recipe (model and data as placeholders)."""
    t = Recipe.model_validate(data).train
    f = lr_multiplier(t.schedule, t.steps)
    return [t.optimizer.lr * f(i) for i in range(t.steps)]


def deepspeed_decay_lr(k: int, T: int, W: int, low: float, high: float) -> float | None:
    """WarmupDecayLR's LR at optimizer step ``k`` (from 0) after its warm-up, as DeepSpeed computes it
    (deepspeed/runtime/lr_schedules.py): the engine steps the scheduler after each optimizer step, so step k trains
    at iteration k - 1; W is max(2, warmup_num_steps); None during the warm-up."""
    i, W = k - 1, max(2, W)
    if i < W:
        return None
    return low + (high - low) * max(0.0, (T - i) / max(1.0, T - W))


@pytest.mark.parametrize("T,W,low", [(10, 3, 0.0), (10, 0, 0.0), (12, 1, 0.0), (20, 5, 2e-4), (7, 6, 0.0)])
def test_warmup_decay_lr_decays_as_deepspeed_does(tmp_path, T, W, low):
    """After the warm-up, the recipe's LR is DeepSpeed's at every optimizer step: it ended at 0 on the last step
    and ran a step early (two reviews), and ignored the floor warmup_min_lr the decay ends at."""
    ds = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 5e-4}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": T, "warmup_num_steps": W,
                                                            "warmup_max_lr": 2e-3, "warmup_min_lr": low,
                                                            "warmup_type": "linear"}}}
    data, _, dropped = _run(tmp_path, ds, hosts=None)
    lrs = _lrs(data)
    assert len(lrs) == T
    after = [(k, deepspeed_decay_lr(k, T, W, low, 2e-3)) for k in range(T)]
    assert data["train"]["schedule"]["warmup_steps"] == max(2, W) + 1  # DeepSpeed's floor, and its lag
    for k, want in after:
        if want is not None:
            assert lrs[k] == pytest.approx(want, rel=1e-12), (k, lrs)
    assert {d.split(":")[0] for d in dropped} == {"optimizer.params.lr"} | ({"scheduler.params.warmup_min_lr"}
                                                                           if low else set())


def test_deepspeeds_scheduler_defaults_apply(tmp_path):
    """WarmupLR with no params: DeepSpeed warms up over 1000 steps to 0.001 by log(i+1), then stays there; the
    recipe took zerorun's 3e-4 with no warm-up. The log warm-up, which zerorun does not have, is named."""
    data, _, dropped = _run(tmp_path, {"scheduler": {"type": "WarmupLR", "params": {}}}, hosts=None)
    s = data["train"]["schedule"]
    assert (s["warmup_steps"], s["decay"], data["train"]["optimizer"]["lr"]) == (1001, "constant", 0.001)
    assert any(d.startswith("scheduler.params.warmup_type: log (DeepSpeed's default)") for d in dropped), dropped
    data, _, _ = _run(tmp_path, {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 50}}},
                      hosts=None)
    assert data["train"]["schedule"] == {"warmup_steps": 1001, "decay": "cosine", "min_lr_ratio": 0.0001}
    # warmup_min_lr == warmup_max_lr: DeepSpeed's constant LR, no warm-up
    data, _, dropped = _run(tmp_path, {"scheduler": {"type": "WarmupLR", "params": {
        "warmup_min_lr": 3e-4, "warmup_max_lr": 3e-4, "warmup_num_steps": -5}}}, hosts=None)
    assert set(_lrs({**data, "train": {**data["train"], "steps": 5}})) == {3e-4} and not dropped


@pytest.mark.parametrize("scheduler", [None, {"type": "OneCycle", "params": {"cycle_min_lr": 1e-5}}])
def test_no_scheduler_keeps_the_lr_constant(tmp_path, scheduler):
    """No scheduler (or one zerorun does not have): DeepSpeed's LR stays the optimizer's; the recipe decayed by
    zerorun's cosine default without a word."""
    ds = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    if scheduler:
        ds["scheduler"] = scheduler
    data, _, dropped = _run(tmp_path, ds, hosts=None)
    assert set(_lrs({**data, "train": {**data["train"], "steps": 20}})) == {1e-4}
    assert (not scheduler) == (not dropped)
    assert not dropped or "the recipe keeps the LR constant" in dropped[0]


def test_an_hf_trainer_config_without_a_scheduler_decays_linearly_to_zero(tmp_path):
    """The HF Trainer makes its own scheduler when the config has none: linear to 0 (lr_scheduler_type's
    default), LR lr (T - i) / T at step i."""
    ds = {"train_micro_batch_size_per_gpu": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    text, _, _ = import_deepspeed(str(path), None, lr=1e-3, steps=8, micro_batch_size=4)
    lrs = _lrs(yaml.safe_load(text))
    assert lrs == pytest.approx([1e-3 * (8 - i) / 8 for i in range(8)], rel=1e-12)
    assert "scheduler: none, so the HF Trainer's own (lr_scheduler_type linear" in text


@pytest.mark.parametrize("value,precision", [("true", "fp16"), (1, "fp16"), ("false", None), (0, None)])
def test_enabled_is_read_as_deepspeed_reads_it(tmp_path, value, precision):
    """DeepSpeed's pydantic models read "true" and 1 as true: `fp16: {enabled: "true"}` trained in fp32."""
    data, _, _ = _run(tmp_path, {"fp16": {"enabled": value}, "tensorboard": {"enabled": value}}, hosts=None)
    assert data.get("precision") == precision
    assert ("tensorboard" in data.get("log", {}).get("trackers", [])) == (precision is not None)
    with pytest.raises(ZerorunError, match=r"ds\.json: bf16\.enabled: expected true or false, got 'maybe'$"):
        _run(tmp_path, {"bf16": {"enabled": "maybe"}}, hosts=None)


def test_hjson_is_read_and_a_duplicate_key_refused(tmp_path):
    """DeepSpeed reads its config with Hjson (comments, trailing commas) and refuses a duplicate key; zerorun
    refused the first and kept the last of the second."""
    data, _, _ = _run(tmp_path, '{\n  // stage 2\n  "zero_optimization": {"stage": 2,},\n}', hosts=None)
    assert data["zero"]["stage"] == 2
    with pytest.raises(ZerorunError, match=r"ds\.json: zero_optimization: duplicate key"):
        _run(tmp_path, '{"zero_optimization": {"stage": 2}, "zero_optimization": {"stage": 3}}', hosts=None)
    with pytest.raises(ZerorunError, match=r"ds\.json:3: not valid JSON: "):  # Hjson's line, not JSON's 1 (a review)
        _run(tmp_path, '// stage 2\n{"zero_optimization": {"stage": 2},\n "fp16": {"enabled" true}}', hosts=None)
    with pytest.raises(ZerorunError, match=r"ds\.json: empty file"):
        _run(tmp_path, "  \n", hosts=None)


def test_batch_size_and_placeholders_are_named(tmp_path):
    """train_batch_size beside micro-batch and accumulation with no hostfile: 63 (not a multiple of 4 x 4) is
    refused as DeepSpeed refuses it; 64 names the 4 ranks it implies. The placeholders (1000 steps, micro-batch
    1) are under "Fill in", not passed off as the config's."""
    with pytest.raises(ZerorunError, match=r"train_batch_size: 63 is not train_micro_batch_size_per_gpu 4 x "):
        _run(tmp_path, {"train_batch_size": 63, "train_micro_batch_size_per_gpu": 4,
                        "gradient_accumulation_steps": 4}, hosts=None)
    _, text, _ = _run(tmp_path, {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4,
                                 "gradient_accumulation_steps": 4}, hosts=None)
    assert "#   ranks: train_batch_size 64 is micro-batch 4 x 4 accumulation steps x 4 ranks: train on 4" in text
    data, text, _ = _run(tmp_path, {"zero_optimization": {"stage": 2}, "gradient_clipping": -1}, hosts=None)
    assert "#   train.steps: not in the config" in text and "#   train.micro_batch_size: not in the config" in text
    r = Recipe.model_validate(data)  # DeepSpeed clips only above 0: -1 wrote a recipe that did not load
    assert r.train.grad_clip is None and math.isfinite(r.train.optimizer.lr)
