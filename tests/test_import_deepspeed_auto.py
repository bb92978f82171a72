"""zerorun import-deepspeed on the Hugging Face Trainer's ZeRO configs, whose values are "auto" (the Trainer fills
them in from its own arguments): the recipe says what to fill in, or takes the values from the options."""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from zerorun.errors import ZerorunError
from zerorun.hf.deepspeed import import_deepspeed
from zerorun.recipe import Recipe

from test_import_deepspeed import _run

#: the HF Trainer's ZeRO-3 config as its documentation gives it (every value "auto"), with DeepSpeed's monitors
HF_ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                          "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                          "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                          "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
    "tensorboard": {"enabled": True, "output_path": "logs/", "job_name": "zero3"},
    "wandb": {"enabled": True, "team": "my-team", "group": "g1", "project": "my-project"},
    "csv_monitor": {"enabled": True, "output_path": "csv/", "job_name": "zero3"},
    "comet": {"enabled": True, "project": "p"},
}
_OFFLOAD_CPU = ("zero_optimization.offload_param: device cpu: zerorun offloads parameters to disk only "
                "(zero.offload_params: disk at stage 3, paged through host memory); stage 3 keeps 1/N of them")


def _filled(data: dict) -> Recipe:
    """The imported recipe with its placeholders filled in (a model module, the default data), validated."""
    return Recipe.model_validate({**data, "model": {"module": "recipes/models/gpt.py"}})


def test_hf_trainer_auto_config_without_options_lists_what_to_fill_in(tmp_path):
    """Every value "auto" (issue 37 part 5): was 31 dropped lines, no learning rate, log.every 2000 of 1000 steps.
    Now: the three values a job must give listed at the top, the Trainer's defaults taken and said, the monitors
    mapped to log.trackers (comet one line), offload_param cpu one line saying what zerorun offers instead."""
    data, text, dropped = _run(tmp_path, HF_ZERO3, None)
    train = data["train"]  # each is 'auto', which does not load until given (zerorun's defaults trained silently)
    assert (train["optimizer"]["lr"], train["steps"], train["micro_batch_size"]) == ("auto", "auto", "auto")
    with pytest.raises(ValueError, match="lr"):
        _filled(data)
    r = _filled({**data, "train": {**train, "optimizer": {**train["optimizer"], "lr": 1e-4}, "steps": 2000,
                                   "micro_batch_size": 2}})
    head = text.split("\n# 'auto' taken")[0]
    for field, flag, hf in (("train.optimizer.lr", "--lr", "learning_rate"), ("train.steps", "--steps", "max_steps"),
                            ("train.micro_batch_size", "--micro-batch-size", "per_device_train_batch_size")):
        assert f"\n#   {field}: 'auto' in the config (the HF Trainer's {hf}): give {flag} or set it" in head, head
    assert r.log.every <= r.train.steps and r.log.trackers == ["tensorboard", "wandb", "csv"]
    assert (r.log.wandb.project, r.log.wandb.entity, r.log.tensorboard.dir) == ("my-project", "my-team", "logs/zero3")
    assert r.train.grad_accum_steps == 1 and r.train.grad_clip == 1.0 and r.precision == "fp32"
    assert r.train.optimizer.kwargs() == {"lr": 1e-4, "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8}
    assert (r.train.schedule.warmup_steps, r.train.schedule.decay) == (3, "linear")  # DeepSpeed's 2, a step behind
    assert (r.zero.stage, r.zero.offload_optimizer, r.zero.offload_params) == (3, "cpu", "none")
    assert sorted(dropped) == [
        "comet: not supported (log.trackers has tensorboard, wandb, mlflow, csv)",
        "csv_monitor.job_name: zerorun writes metrics.csv in the run folder",
        "csv_monitor.output_path: zerorun writes metrics.csv in the run folder",
        "scheduler.params.warmup_type: log (DeepSpeed's default): zerorun's warm-up is linear, from lr/warmup_steps",
        "wandb.group: no zerorun equivalent (runs are named after the run folder)",
        _OFFLOAD_CPU,
        "zero_optimization.stage3_gather_16bit_weights_on_model_save: zerorun consolidate writes full weights from "
        "any checkpoint",
        "zero_optimization.stage3_max_live_parameters: stage 3 holds the gathered units and those prefetched "
        "(zero.prefetch_bytes)",
        "zero_optimization.stage3_max_reuse_distance: stage 3 frees a unit after its forward and its backward",
        "zero_optimization.sub_group_size: disk offload pages through zero.offload_buffer_mb instead"]


def test_hf_trainer_auto_config_with_the_options(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(HF_ZERO3))
    text, dropped, fill_in = import_deepspeed(str(path), lr=2e-5, steps=100, micro_batch_size=4)
    r = _filled(yaml.safe_load(text))
    assert (r.train.optimizer.lr, r.train.steps, r.train.micro_batch_size, r.log.every) == (2e-5, 100, 4, 100)
    assert fill_in == ["model, data: placeholders (a model module or model.hf; your data)"]
    assert "'auto' in the config" not in text and _OFFLOAD_CPU in dropped
    # an option only fills what the config leaves to the Trainer: a different number there is one line
    ds = {**HF_ZERO3, "train_micro_batch_size_per_gpu": 8, "steps_per_print": 10}
    path.write_text(json.dumps(ds))
    with pytest.raises(ZerorunError, match=r"^\S+ds\.json: train_micro_batch_size_per_gpu: 8 in the config and "
                                           r"--micro-batch-size 4: give one$"):
        import_deepspeed(str(path), micro_batch_size=4)
    r = _filled(yaml.safe_load(import_deepspeed(str(path), micro_batch_size=8, steps=1000, lr=1e-4)[0]))
    assert (r.train.micro_batch_size, r.log.every) == (8, 10)
    for bad in (0.0, float("nan"), float("inf"), -1e-3):  # typer takes each as a float
        with pytest.raises(ZerorunError, match=rf"^--lr: expected a learning rate > 0, got {bad}$"):
            import_deepspeed(str(path), lr=bad)
    # no config section for them: the options still set the recipe (the Trainer's AdamW)
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    r = _filled(yaml.safe_load(import_deepspeed(str(path), lr=1e-3, steps=7, micro_batch_size=2)[0]))
    assert (r.train.optimizer.name, r.train.optimizer.lr, r.train.steps, r.train.micro_batch_size) == \
        ("AdamW", 1e-3, 7, 2)


def test_cli_takes_the_auto_options_and_says_what_to_fill_in(tmp_path, monkeypatch, capsys):
    from zerorun.cli import main

    (tmp_path / "ds.json").write_text(json.dumps(HF_ZERO3))
    monkeypatch.setattr(sys, "argv", ["zerorun", "import-deepspeed", str(tmp_path / "ds.json"), "--steps", "50"])
    main()
    out, err = capsys.readouterr()
    assert yaml.safe_load(out)["train"]["steps"] == 50 and yaml.safe_load(out)["log"]["every"] == 50
    assert "zerorun: fill in train.optimizer.lr: 'auto' in the config (the HF Trainer's learning_rate): give --lr " \
           "or set it\n" in err and "fill in train.steps" not in err
    assert f"zerorun: dropped {_OFFLOAD_CPU}\n" in err
