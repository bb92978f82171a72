"""zerorun import-deepspeed: a DeepSpeed config becomes a recipe that validates; dropped fields are listed;
bad input is one line and exit 2."""

from __future__ import annotations

import json
import sys

import pytest
import yaml

from zerorun.errors import ZerorunError
from zerorun.hf.deepspeed import import_deepspeed
from zerorun.recipe import Recipe

DS = {
    "train_batch_size": 64, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0, "steps_per_print": 50,
    "fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 500, "min_loss_scale": 2,
             "hysteresis": 2, "loss_scale": 0},
    "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                                             "torch_adam": True}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 100, "total_num_steps": 2000,
                                                       "cos_min_ratio": 0.05}},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "reduce_bucket_size": 1048576,
                          "stage3_param_persistence_threshold": 1e4, "stage3_prefetch_bucket_size": 5e7,
                          "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True},
                          "offload_param": {"device": "cpu"}},
    "wall_clock_breakdown": False,
}


def _run(tmp_path, ds, hosts: str | None = "localhost slots=2\n127.0.0.1 slots=2\n"):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds) if isinstance(ds, dict) else ds)
    hostfile = None
    if hosts is not None:
        hostfile = tmp_path / "hosts"
        hostfile.write_text(hosts)
    text, dropped, _ = import_deepspeed(str(path), str(hostfile) if hostfile else None)
    return yaml.safe_load(text), text, dropped


def test_maps_the_fields_with_a_meaning_here(tmp_path):
    data, text, dropped = _run(tmp_path, DS)
    r = Recipe.model_validate(data)  # a valid recipe once model and data are filled in
    t = r.train
    assert (t.micro_batch_size, t.grad_accum_steps, t.steps, t.grad_clip) == (8, 2, 2000, 1.0)  # 64 = 8 x 2 x 4 ranks
    assert t.optimizer.name == "AdamW" and t.optimizer.kwargs() == {"lr": 3e-4, "weight_decay": 0.1, "eps": 1e-8,
                                                                     "betas": [0.9, 0.95]}
    # DeepSpeed's 100 warm-up iterations, and its engine's one-step lag (Note [DeepSpeed's schedules])
    assert (t.schedule.warmup_steps, t.schedule.decay, t.schedule.min_lr_ratio) == (101, "cosine", 0.05)
    assert r.precision == "fp16"
    assert (r.loss_scale.initial_scale, r.loss_scale.growth_interval, r.loss_scale.min_scale) == (4096.0, 500, 2.0)
    z = r.zero
    assert (z.stage, z.offload_optimizer, z.offload_path, z.persistence_threshold) == (3, "disk", "/local_nvme", 10000)
    assert z.bucket_mb == 2.0  # 1Mi elements of 2-byte gradients
    assert z.prefetch_bytes == 10**8  # 5e7 elements ahead of use, 2 bytes each
    bad = {"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": -1}}
    with pytest.raises(ZerorunError, match=r"stage3_prefetch_bucket_size: expected >= 0 elements, got -1"):
        _run(tmp_path, bad)
    assert r.launch.procs_per_node == 2 and r.log.every == 50
    fields = {d.split(":")[0] for d in dropped}  # overlap_comm, pin_memory true: what zerorun does; a false flag
    assert fields == {"fp16.hysteresis", "optimizer.params.torch_adam", "zero_optimization.offload_param",
                      "scheduler.params.warmup_type"}, dropped  # DeepSpeed's default warm-up is log
    assert all(f"#   {d}" in text for d in dropped)


def test_grad_accum_dtype(tmp_path):
    data, _, dropped = _run(tmp_path, {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}})
    assert Recipe.model_validate(data).zero.grad_accum_dtype == "fp32" and not dropped
    with pytest.raises(ZerorunError, match=r"ds\.json: data_types\.grad_accum_dtype: 'fp64' is not fp32, bf16"):
        _run(tmp_path, {"data_types": {"grad_accum_dtype": "fp64"}})


def test_adam_without_decoupled_decay_and_auto_values(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 4,
          "optimizer": {"type": "Adam", "params": {"lr": "auto", "adam_w_mode": False}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 1e-3}},
          "bf16": {"enabled": True}, "zero_optimization": {"stage": 1, "reduce_bucket_size": 1048576}}
    data, text, dropped = _run(tmp_path, ds, hosts=None)
    # what the Trainer fills in is 'auto' in the recipe, which does not load until given (zerorun's defaults
    # trained silently in its place: micro-batch 1, 1000 steps)
    assert data["train"]["micro_batch_size"] == "auto" and data["train"]["steps"] == "auto"
    with pytest.raises(ValueError):
        Recipe.model_validate(data)
    r = Recipe.model_validate({**data, "train": {**data["train"], "micro_batch_size": 2, "steps": 10}})
    assert r.train.optimizer.name == "Adam" and r.train.optimizer.lr == 1e-3 and r.train.grad_accum_steps == 4
    assert r.train.schedule.decay == "constant" and r.precision == "bf16" and r.zero.bucket_mb == 2.0
    assert [d.split(":")[0] for d in dropped] == ["scheduler.params.warmup_type"]  # log, DeepSpeed's default
    # the fill-ins are listed:
    assert "\n#   train.micro_batch_size: 'auto' in the config (the HF Trainer's per_device_train_batch_size): give " \
           "--micro-batch-size or set it\n" in text
    assert "train.optimizer.lr" not in text  # 'auto' beside the scheduler's warmup_max_lr: that one


def test_auto_precision_is_the_trainers_default_and_says_so(tmp_path):
    """The HF Trainer's usual `fp16: {enabled: auto}`: fp32, its default (Note [HF Trainer auto]), said in one
    comment line naming what to set, never silently dropped as 'fp16 is not enabled' field by field."""
    ds = {"fp16": {"enabled": "auto", "initial_scale_power": 16, "loss_scale_window": 1000},
          "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2}}
    data, text, dropped = _run(tmp_path, ds, hosts=None)
    assert "precision" not in data and "loss_scale" not in data and not dropped
    assert "\n#   fp16.enabled and bf16.enabled: fp32 (the HF Trainer's default; set precision: bf16, or fp16 and " \
           "its loss_scale, if your TrainingArguments set bf16/fp16)\n" in text


@pytest.mark.parametrize("ds,hosts,pattern", [
    ('{"zero_optimization": {"stage": 2', None, r"ds\.json:1: not valid JSON"),
    ("[1, 2]", None, r"ds\.json: a DeepSpeed config is a JSON object"),
    ({"zero_optimization": {"stage": 5}}, None, r"ds\.json: zero_optimization\.stage: 5 is not a ZeRO stage"),
    ({"zero_optimization": {"stage": "two"}}, None, r"zero_optimization\.stage: expected an integer, got 'two'"),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, "localhost slots=2\n",
     r"train_batch_size: 30 is not micro-batch x accumulation x 2 ranks"),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
     "localhost slots=2\n", r"train_batch_size: 32 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, None, r"bf16\.enabled and fp16\.enabled: both true"),
    # betas: [true, 0.9] became [1.0, 0.9]; a string failed without naming betas; Infinity reached the recipe
    ({"optimizer": {"type": "AdamW", "params": {"betas": [True, 0.9]}}}, None,
     r"ds\.json: optimizer\.params\.betas\.0: expected a finite number, got True$"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": "0.9"}}}, None,
     r"ds\.json: optimizer\.params\.betas: expected a list of two numbers, got '0\.9'$"),
    ('{"optimizer": {"type": "AdamW", "params": {"eps": Infinity}}}', None,
     r"ds\.json: optimizer\.params\.eps: expected a finite number, got inf$"),
    ('{"optimizer": {"type": "AdamW", "params": {"betas": [0.9, NaN]}}}', None,
     r"ds\.json: optimizer\.params\.betas\.1: expected a finite number, got nan$"),
    # a review's list: errors that named no field, values ignored or carried into a recipe that failed to load
    ({"zero_optimization": {"stage": 3, "offload_param": "nvme"}}, None,
     r"ds\.json: zero_optimization\.offload_param: expected a mapping, got 'nvme'$"),
    ({"zero_optimization": {"offload_optimizer": True}}, None, r"zero_optimization\.offload_optimizer: expected a mapping"),
    ({"optimizer": "Adam"}, None, r"ds\.json: optimizer: expected a mapping, got 'Adam'$"),
    ({"zero_optimization": [2]}, None, r"ds\.json: zero_optimization: expected a mapping, got \[2\]$"),
    ({"optimizer": {"type": "Adam", "params": [1, 2]}}, None, r"optimizer\.params: expected a mapping, got \[1, 2\]$"),
    ({"scheduler": "WarmupLR"}, None, r"ds\.json: scheduler: expected a mapping"),
    *[({"zero_optimization": {"stage": 3, section: {"device": bad}}}, None,
       rf"zero_optimization\.{section}\.device: expected none, cpu or nvme, got '{bad}'$")
      for section in ("offload_optimizer", "offload_param") for bad in ("gpu", "NVMe", "auto")],
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": 5}}}, None,
     r"zero_optimization\.offload_optimizer\.nvme_path: expected a folder path, got 5$"),
    ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": "false"}}}, None,
     r"optimizer\.params\.adam_w_mode: expected true or false, got 'false'$"),
    ({"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": ""}, "stage": 3}}, None,
     r"zero_optimization\.offload_param\.nvme_path: expected a folder path, got ''$"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95, 0.99]}}}, None,
     r"optimizer\.params\.betas: expected a list of two numbers, got \[0\.9, 0\.95, 0\.99\]$"),
])
def test_bad_config_is_one_line(tmp_path, ds, hosts, pattern):
    with pytest.raises(ZerorunError, match=pattern) as e:
        _run(tmp_path, ds, hosts)
    assert "\n" not in str(e.value)


def test_auto_betas_are_the_trainers_default(tmp_path):
    recipe, text, dropped = _run(tmp_path, {"optimizer": {"type": "AdamW", "params": {"lr": "auto",
                                                                                      "betas": "auto"}}}, None)
    assert recipe["train"]["optimizer"] == {"name": "AdamW", "betas": [0.9, 0.999], "lr": "auto"} and not dropped
    assert "#   optimizer.params.betas: [0.9, 0.999] (the HF Trainer's default adam_beta1, adam_beta2)" in text
    assert "#   train.optimizer.lr: 'auto' in the config (the HF Trainer's learning_rate): give --lr" in text


def test_parameter_offload_to_nvme_is_zeroruns_disk_offload(tmp_path):
    """offload_param was always dropped as "not supported"; zerorun's stage 3 pages parameter slices from a
    file (zero.offload_params: disk): device nvme maps to it, in the optimizer's folder when both are given."""
    z = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme/p", "pin_memory": True}}
    data, _, dropped = _run(tmp_path, {"zero_optimization": z}, None)
    r = Recipe.model_validate(data)
    assert (r.zero.offload_params, r.zero.offload_path, r.zero.offload_optimizer) == ("disk", "/nvme/p", "none")
    assert dropped == ["zero_optimization.offload_param.pin_memory: no zerorun equivalent"]
    z["offload_optimizer"] = {"device": "nvme", "nvme_path": "/nvme/o"}
    data, _, dropped = _run(tmp_path, {"zero_optimization": z}, None)
    assert data["zero"]["offload_path"] == "/nvme/o" and data["zero"]["offload_params"] == "disk"
    assert any(d.startswith("zero_optimization.offload_param.nvme_path: one folder") for d in dropped), dropped
    data, _, dropped = _run(tmp_path, {"zero_optimization": {"stage": 2, "offload_param": {"device": "nvme"}}}, None)
    assert "offload_params" not in data["zero"] and dropped == ["zero_optimization.offload_param: stage 3 only"]


def test_optimizer_params_torch_takes_are_carried(tmp_path):
    """amsgrad, nesterov and dampening were dropped as "no torch.optim equivalent" (the recipe then trained
    without them); momentum was carried into Adam, which has no such argument. Now each class gets the
    params torch.optim's class takes, checked, and the rest are listed with the reason."""
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "amsgrad": True, "momentum": 0.9, "torch_adam": True,
                                                    "bias_correction": False}}}
    data, _, dropped = _run(tmp_path, ds, None)
    Recipe.model_validate(data)
    assert data["train"]["optimizer"] == {"name": "AdamW", "lr": 1e-3, "amsgrad": True}
    assert sorted(dropped) == ["optimizer.params.bias_correction: torch.optim.AdamW always corrects the bias",
                               "optimizer.params.momentum: not an argument of torch.optim.AdamW",
                               "optimizer.params.torch_adam: chooses an implementation; zerorun's ranks run "
                               "torch.optim.AdamW"]
    ds = {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9, "nesterov": True, "dampening": 0}}}
    data, _, dropped = _run(tmp_path, ds, None)
    assert data["train"]["optimizer"] == {"name": "SGD", "lr": 0.1, "momentum": 0.9, "nesterov": True,
                                          "dampening": 0.0} and not dropped
    ds = {"optimizer": {"type": "Adagrad", "params": {"lr": 0.1, "lr_decay": 0.01, "initial_accumulator_value": 0.5}}}
    assert _run(tmp_path, ds, None)[0]["train"]["optimizer"] == {"name": "Adagrad", "lr": 0.1, "lr_decay": 0.01,
                                                                  "initial_accumulator_value": 0.5}
    for bad in ("true", 1):  # read for its truth by torch.optim
        with pytest.raises(ZerorunError, match=rf"optimizer\.params\.amsgrad: expected true or false, got {bad!r}$"):
            _run(tmp_path, {"optimizer": {"type": "Adam", "params": {"amsgrad": bad}}}, None)
    _, _, dropped = _run(tmp_path, {"optimizer": {"type": "SGD", "params": {"nesterov": "auto"}}}, None)
    assert any(d.startswith("optimizer.params.nesterov: 'auto'") for d in dropped), dropped


def test_cli_prints_the_recipe_and_exits_2_on_bad_input(tmp_path, monkeypatch, capsys):
    from zerorun.cli import main

    (tmp_path / "ds.json").write_text(json.dumps(DS))
    monkeypatch.setattr(sys, "argv", ["zerorun", "import-deepspeed", str(tmp_path / "ds.json")])
    main()
    out, err = capsys.readouterr()
    assert yaml.safe_load(out)["zero"]["stage"] == 3
    assert "zerorun: dropped zero_optimization.offload_param:" in err
    # without a hostfile train_batch_size cannot be split: dropped, said so
    assert "train_batch_size: needs the world size" in err
    monkeypatch.setattr(sys, "argv", ["zerorun", "import-deepspeed", str(tmp_path / "missing.json")])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing.json: cannot read DeepSpeed config" in err[0], err


def test_auto_schedule_values_are_left_out_and_betas_only_for_adam(tmp_path):
    """The HF Trainer's usual WarmupLR with every value "auto" wrote ``warmup_steps: null`` (and WarmupCosineLR's
    ``cos_min_ratio: auto`` ``min_lr_ratio: null``): listed as dropped, yet the recipe failed to load. betas was
    carried into SGD and Adagrad, which have no such argument; adam_w_mode under SGD vanished unlisted."""
    auto = {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}
    for kind, extra in (("WarmupLR", {}), ("WarmupCosineLR", {"cos_min_ratio": "auto", "total_num_steps": "auto"})):
        data, text, dropped = _run(tmp_path, {"scheduler": {"type": kind, "params": {**auto, **extra}}}, None)
        assert None not in data["train"]["schedule"].values(), data["train"]
        Recipe.model_validate({**data, "train": {**data["train"], "optimizer": {"name": "AdamW", "lr": 1e-3},
                                                 "steps": 100}})
        # the Trainer's default warmup_steps 0, said so; DeepSpeed warms up over at least 2 iterations, a step behind
        assert data["train"]["schedule"]["warmup_steps"] == 3
        assert "#   scheduler.params.warmup_num_steps: 0 (the HF Trainer's default warmup_steps)" in text
    for kind in ("SGD", "Adagrad"):
        data, _, dropped = _run(tmp_path, {"optimizer": {"type": kind, "params": {"lr": 0.1, "betas": [0.9, 0.99],
                                                                              "adam_w_mode": False}}}, None)
        assert data["train"]["optimizer"] == {"name": kind, "lr": 0.1}
        assert sorted(dropped) == [f"optimizer.params.adam_w_mode: not an argument of torch.optim.{kind}",
                                   f"optimizer.params.betas: not an argument of torch.optim.{kind}"]


def test_one_folder_for_both_swap_files(tmp_path):
    """The optimizer's nvme_path, else the parameters' (an unset optimizer path took an invented default over
    the parameters' given one); a different second path is listed."""
    z = {"stage": 3, "offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "nvme", "nvme_path": "/p"}}
    data, _, dropped = _run(tmp_path, {"zero_optimization": z}, None)
    assert data["zero"]["offload_path"] == "/p" and not dropped
    z["offload_optimizer"]["nvme_path"] = "/o"
    data, _, dropped = _run(tmp_path, {"zero_optimization": z}, None)
    assert data["zero"]["offload_path"] == "/o"
    assert dropped == ["zero_optimization.offload_param.nvme_path: one folder holds both swap files here: "
                       "zero.offload_path is /o"]


def test_review_leftovers(tmp_path):
    """maximize and Adam's decoupled_weight_decay are torch arguments (were "not an argument"); an 'auto' item
    of betas wrote null; an nvme_path beside device cpu is unused, so not checked; offload_param's keys at stage 2
    are not listed twice."""
    data, _, dropped = _run(tmp_path, {"optimizer": {"type": "SGD", "params": {"lr": 0.1, "maximize": True}}}, None)
    assert data["train"]["optimizer"] == {"name": "SGD", "lr": 0.1, "maximize": True} and not dropped
    data, _, _ = _run(tmp_path, {"optimizer": {"type": "Adam", "params": {"adam_w_mode": False,
                                                                         "decoupled_weight_decay": True}}}, None)
    assert data["train"]["optimizer"] == {"name": "Adam", "decoupled_weight_decay": True}
    data, _, dropped = _run(tmp_path, {"optimizer": {"type": "AdamW", "params": {"betas": [0.9, "auto"]}}}, None)
    assert "betas" not in data["train"]["optimizer"]
    assert dropped == ["optimizer.params.betas: [0.9, 'auto'] has an 'auto' item (filled in by the HF Trainer "
                       "integration): set both in the recipe"]  # the 0.9 is named too
    # DeepSpeed's deprecated "zero_optimization": true is stage 1 (was "expected a mapping")
    for flag, stage in ((True, 1), (False, 0)):
        assert _run(tmp_path, {"zero_optimization": flag}, None)[0]["zero"]["stage"] == stage
    data, _, dropped = _run(tmp_path, {"zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "cpu", "nvme_path": ""}}}, None)
    assert data["zero"]["offload_optimizer"] == "cpu" and "offload_path" not in data["zero"]
    _, _, dropped = _run(tmp_path, {"zero_optimization": {"stage": 2, "offload_param": {
        "device": "nvme", "pin_memory": True}}}, None)
    assert dropped == ["zero_optimization.offload_param: stage 3 only"]


def test_hpz_partition_size_is_zero_hierarchy(tmp_path):
    """ZeRO++'s ``zero_hpz_partition_size`` N > 1 is ``zero.hierarchy: N`` (Note [Secondary shards]); 1 is flat
    stage 3, nothing to say; below stage 3 it is listed as dropped; a bad size is one line naming the field
    (before: every value was dropped as "no zerorun equivalent")."""
    data, _, dropped = _run(tmp_path, {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}})
    assert Recipe.model_validate(data).zero.hierarchy == 2 and not dropped
    data, _, dropped = _run(tmp_path, {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 1}})
    assert "hierarchy" not in data["zero"] and not dropped
    data, _, dropped = _run(tmp_path, {"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}})
    assert "hierarchy" not in data["zero"]
    assert dropped == ["zero_optimization.zero_hpz_partition_size: stage 3 only (zero.hierarchy)"]
    nvme = {"stage": 3, "zero_hpz_partition_size": 2, "offload_param": {"device": "nvme", "nvme_path": "/tmp/x"}}
    data, _, dropped = _run(tmp_path, {"zero_optimization": nvme})  # a recipe zerorun takes (it refused both)
    assert "hierarchy" not in data["zero"] and Recipe.model_validate(data).zero.offload_params == "disk"
    assert dropped == ["zero_optimization.zero_hpz_partition_size: its secondary shard lives in memory; "
                       "offload_param nvme keeps the parameters on disk (zero.offload_params: disk)"]
    for size, message in ((0, "expected a number of ranks >= 1, got 0"), (1.5, "expected an integer, got 1.5"),
                          (3, "3 must divide the hostfile's 4 ranks and be below it")):
        with pytest.raises(ZerorunError, match=rf"ds\.json: zero_optimization\.zero_hpz_partition_size: {message}$"):
            _run(tmp_path, {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": size}})


@pytest.mark.parametrize("key,field,value,below,why", [
    ("zero_quantized_weights", "quantize_weights", "int8", 2, "stage 3 only (zero.quantize_weights)"),
    ("zero_quantized_gradients", "quantize_grads", "int4", 2, "DeepSpeed applies it at stage 3 only "
                                                               "(zero.quantize_grads takes stages 1-3: set it to "
                                                               "quantize here)")])
def test_quantized_collectives_are_zero_quantize_switches(tmp_path, key, field, value, below, why):
    """ZeRO++'s ``zero_quantized_weights: true`` is ``zero.quantize_weights: int8`` (stage 3, Note [Quantized
    weights]), ``zero_quantized_gradients: true`` is ``zero.quantize_grads: int4`` (DeepSpeed's qgZ width, Note
    [Quantized gradients]; before: dropped as not taken yet), both at stage 3 only as DeepSpeed reads them (at
    stage 2 DeepSpeed trains exact: listed as dropped); false is nothing; not a boolean: one line."""
    data, _, dropped = _run(tmp_path, {"zero_optimization": {"stage": 3, key: True}})
    assert getattr(Recipe.model_validate(data).zero, field) == value and not dropped
    data, text, dropped = _run(tmp_path, {"zero_optimization": {"stage": below, key: True}})
    assert field not in data["zero"] and dropped == [f"zero_optimization.{key}: {why}"] and f"#   {dropped[0]}" in text
    assert _run(tmp_path, {"zero_optimization": {"stage": 3, key: False}})[2] == []
    with pytest.raises(ZerorunError, match=rf"zero_optimization\.{key}: expected true or false, got 'yes'$"):
        _run(tmp_path, {"zero_optimization": {"stage": 3, key: "yes"}})


def test_steps_per_print_is_kept_when_train_steps_is_not_known(tmp_path):
    """A review: with train.steps unknown (the 1000-step placeholder to fill in), steps_per_print 2000 became
    log.every 1000, the placeholder's, not DeepSpeed's 2000; with total_num_steps known it is capped by it."""
    data, _, _ = _run(tmp_path, {"steps_per_print": 2000, "train_micro_batch_size_per_gpu": 1})
    assert data["log"]["every"] == 2000 and data["train"]["steps"] == 1000
    Recipe.model_validate(data)  # every above steps is a recipe: a job logs its last step anyway
    data, _, _ = _run(tmp_path, {"steps_per_print": 2000, "train_micro_batch_size_per_gpu": 1,
                                 "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 500}}})
    assert data["log"]["every"] == 500 and data["train"]["steps"] == 500
