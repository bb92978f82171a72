"""``zerorun import-deepspeed ds_config.json [--hostfile H] > recipe.yaml``: a DeepSpeed config mapped to a
zerorun recipe, so a DeepSpeed user starts from their own settings.

Mapped (DeepSpeed field -> recipe field): ``zero_optimization.stage`` -> ``zero.stage`` (the deprecated
``"zero_optimization": true`` is stage 1, as DeepSpeed reads it); ``offload_optimizer.device`` cpu/nvme ->
``zero.offload_optimizer`` cpu/disk and ``offload_param.device`` nvme -> ``zero.offload_params`` disk (stage 3),
their ``nvme_path`` -> ``zero.offload_path`` (one folder for both); ``reduce_bucket_size`` (elements) ->
``zero.bucket_mb`` (at the gradients' element size); ``stage3_param_persistence_threshold`` ->
``zero.persistence_threshold``; ``stage3_prefetch_bucket_size`` (elements) -> ``zero.prefetch_bytes`` (at the
parameters' element size); ``bf16``/``fp16.enabled`` -> ``precision``; fp16's
``initial_scale_power``/``loss_scale_window``/``min_loss_scale`` -> ``loss_scale``; ``communication_data_type``
fp32 -> ``zero.reduce_dtype``; ``data_types.grad_accum_dtype`` -> ``zero.grad_accum_dtype``;
``gradient_clipping`` -> ``train.grad_clip``; ``train_micro_batch_size_per_gpu``/``gradient_accumulation_steps``
(or derived from ``train_batch_size`` and the hostfile's slots) -> ``train.micro_batch_size``/``grad_accum_steps``;
``optimizer`` (Adam/AdamW/SGD/Adagrad and the params torch.optim's class also takes: :data:`CARRIED`) ->
``train.optimizer``; ``scheduler`` WarmupLR/WarmupDecayLR/WarmupCosineLR, or none -> ``train.schedule`` (and
``train.steps`` from ``total_num_steps``: Note [DeepSpeed's schedules] in ``deepspeed_schedule.py``);
``steps_per_print`` -> ``log.every`` (at most a known ``train.steps``);
the ``tensorboard``/``wandb``/``csv_monitor`` monitors -> ``log.trackers``. The HF Trainer's ``"auto"`` values
are filled in first (Note [HF Trainer auto] in ``deepspeed_auto.py``). Every other field is listed as dropped,
with the reason, in the recipe's header comment and on stderr, except a flag zerorun always follows set true
and a feature left off (false, ``enabled: false``).
"""

from __future__ import annotations

import math
from typing import Any

import yaml

from zerorun.errors import ZerorunError
from zerorun.hf.deepspeed_auto import check_options, has_auto, mark_fill_in, monitors, resolve_auto
from zerorun.hf.deepspeed_fields import ALWAYS, CARRIED, not_carried, parse_config, zero_plus_plus
from zerorun.hf.deepspeed_schedule import finish_schedule, map_scheduler

class _Import:
    def __init__(self, ds: dict, world_size: int | None, given: dict[str, Any], hf_config: bool) -> None:
        self.ds, self.world, self.given, self.hf_config = ds, world_size, given, hf_config
        self.dropped: list[str] = []
        self.fill_in: list[str] = []  # "field: why" lines for the recipe's header
        self.steps_known = 0  # train.steps from --steps or the scheduler's total_num_steps (0: the placeholder)
        self.recipe: dict[str, Any] = {"name": "imported",
                                       "model": {"module": "path/to/model.py", "factory": "build_model"},
                                       "data": {"kind": "text", "paths": ["{stdlib}/**/*.py"], "seq_len": 128},
                                       "train": {"steps": 1000, "micro_batch_size": 1}, "zero": {}}

    def drop(self, field: str, why: str) -> None:
        self.dropped.append(f"{field}: {why}")

    def num(self, field: str, value: Any, kind=float) -> Any:
        if value == "auto":
            self.drop(field, "'auto' (filled in by the HF Trainer integration): set it in the recipe")
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or (kind is int and value != int(value)):  # JSON's Infinity and NaN too: the recipe refuses them
            raise ZerorunError(f"{field}: expected {'an integer' if kind is int else 'a finite number'}, "
                               f"got {value!r}")
        return kind(value)

    def section(self, field: str, value: Any) -> dict:
        """A mapping of the config (``{}`` when absent or null)."""
        if value is None:
            return {}
        if not isinstance(value, dict):  # "offload_param": "nvme" failed as "'str' object has no attribute 'get'"
            raise ZerorunError(f"{field}: expected a mapping, got {value!r}")
        return value

    def device(self, name: str, section: dict) -> str:
        """``offload_optimizer``'s or ``offload_param``'s device: none, cpu or nvme (DeepSpeed's values)."""
        device = section.get("device", "none")
        if device not in ("none", "cpu", "nvme"):  # "gpu", "NVMe", "auto" were ignored without a word
            raise ZerorunError(f"zero_optimization.{name}.device: expected none, cpu or nvme, got {device!r}")
        return device

    def path(self, field: str, value: Any) -> str:
        """An ``nvme_path``: a non-empty string."""
        if not isinstance(value, str) or not value.strip():
            raise ZerorunError(f"{field}: expected a folder path, got {value!r}")
        return value

    def flag(self, field: str, value: Any) -> bool | None:
        """A boolean optimizer argument (``amsgrad``, ``nesterov``); 'auto' is listed as dropped."""
        if value == "auto":
            return self.num(field, value)
        if not isinstance(value, bool):  # "false" or 0 would be read for its truth by torch.optim
            raise ZerorunError(f"{field}: expected true or false, got {value!r}")
        return value

    def run(self) -> dict:
        ds = dict(self.ds)
        self.precision(ds)
        self.batch(ds)
        z = ds.pop("zero_optimization", None)
        if isinstance(z, bool):  # DeepSpeed's deprecated form: true is stage 1 (read_zero_config_deprecated)
            z = {"stage": 1 if z else 0}
        self.zero(dict(self.section("zero_optimization", z or None)))  # 0, [] and "" read as absent, as before
        self.optimizer(ds.pop("optimizer", None))
        end = map_scheduler(self, ds.pop("scheduler", None))  # Note [DeepSpeed's schedules]
        train = self.recipe["train"]
        if self.given.get("steps"):
            train["steps"] = self.steps_known = self.given["steps"]
        finish_schedule(self.recipe, self.steps_known, end)
        if self.given.get("lr"):  # the HF Trainer's optimizer is AdamW
            train.setdefault("optimizer", {"name": "AdamW"})["lr"] = self.given["lr"]
        if "gradient_clipping" in ds:
            clip = self.num("gradient_clipping", ds.pop("gradient_clipping"))
            if clip and clip > 0:  # DeepSpeed clips only above 0 (-1 wrote a recipe that did not load)
                train["grad_clip"] = clip
        log = monitors(ds, self.drop)  # Note [HF Trainer auto] in deepspeed_auto.py
        if "steps_per_print" in ds:
            every = self.num("steps_per_print", ds.pop("steps_per_print"), int)
            if every:  # not above train.steps once known (not the 1000-step placeholder): its last step logs anyway
                log["every"] = min(every, train["steps"]) if self.steps_known else every
        if log:
            self.recipe["log"] = log
        comm = ds.pop("communication_data_type", None)
        if comm in ("fp32", "float32") and self.recipe.get("precision", "fp32") != "fp32":
            self.recipe["zero"]["reduce_dtype"] = "fp32"
        elif comm is not None:
            self.drop("communication_data_type", f"{comm}: gradients are reduced in the parameters' precision")
        data_types = ds.pop("data_types", None) or {}
        accum = data_types.pop("grad_accum_dtype", None) if isinstance(data_types, dict) else None
        if accum is not None:
            if accum not in ("fp32", "bf16", "fp16"):
                raise ZerorunError(f"data_types.grad_accum_dtype: {accum!r} is not fp32, bf16 or fp16")
            self.recipe["zero"]["grad_accum_dtype"] = accum
        for key in sorted(data_types) if isinstance(data_types, dict) else ["data_types"]:
            self.drop(f"data_types.{key}" if isinstance(data_types, dict) else key, "no zerorun equivalent")
        if ds.pop("activation_checkpointing", None):
            self.drop("activation_checkpointing", "set train.activation_checkpointing: true (stage 3 checkpoints "
                                                  "each unit)")
        for key in sorted(ds):  # false, or a section not enabled: nothing turned on is lost
            if ds[key] is not False and not (isinstance(ds[key], dict) and ds[key].get("enabled") is False):
                self.drop(key, "no zerorun equivalent")
        if not self.recipe["zero"]:
            del self.recipe["zero"]
        return self.recipe

    def precision(self, ds: dict) -> None:
        bf16 = ds.pop("bf16", None) or ds.pop("bfloat16", None) or {}
        fp16 = ds.pop("fp16", None) or {}
        if bf16.get("enabled") is True and fp16.get("enabled") is True:
            raise ZerorunError("bf16.enabled and fp16.enabled: both true; DeepSpeed refuses this too")
        for key in sorted(set(bf16) - {"enabled"}):
            self.drop(f"bf16.{key}", "no zerorun equivalent")
        for name, section in (("bf16", bf16), ("fp16", fp16)):
            if section.get("enabled") == "auto":
                self.drop(f"{name}.enabled", "'auto' (filled in by the HF Trainer integration): set precision: "
                          f"{name} in the recipe to train in {name}")
        if bf16.get("enabled") is True:
            self.recipe["precision"] = "bf16"
        if fp16.get("enabled") is True:
            self.recipe["precision"] = "fp16"
            scale: dict[str, Any] = {}
            if fp16.get("loss_scale", 0):
                self.drop("fp16.loss_scale", "a static loss scale: zerorun scales dynamically (loss_scale.*)")
            if "initial_scale_power" in fp16:
                scale["initial_scale"] = float(2 ** self.num("fp16.initial_scale_power", fp16["initial_scale_power"], int))
            if "loss_scale_window" in fp16:
                scale["growth_interval"] = self.num("fp16.loss_scale_window", fp16["loss_scale_window"], int)
            if "min_loss_scale" in fp16:
                scale["min_scale"] = self.num("fp16.min_loss_scale", fp16["min_loss_scale"])
            for key in sorted(set(fp16) - {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window",
                                           "min_loss_scale"}):
                self.drop(f"fp16.{key}", "no zerorun equivalent" if key != "hysteresis"
                          else "zerorun backs off at the first overflow")
            if scale:
                self.recipe["loss_scale"] = scale
        else:
            why = "fp16.enabled is 'auto': with precision: fp16, set loss_scale.* in the recipe" \
                if fp16.get("enabled") == "auto" else "fp16 is not enabled"
            for key in sorted(set(fp16) - {"enabled"}):
                self.drop(f"fp16.{key}", why)

    def batch(self, ds: dict) -> None:
        train = self.recipe["train"]
        micro = ds.pop("train_micro_batch_size_per_gpu", None)
        accum = ds.pop("gradient_accumulation_steps", None)
        total = ds.pop("train_batch_size", None)
        micro = None if micro is None else self.num("train_micro_batch_size_per_gpu", micro, int)
        accum = None if accum is None else self.num("gradient_accumulation_steps", accum, int)
        total = None if total is None else self.num("train_batch_size", total, int)
        if total is not None and (micro is None or accum is None):
            if self.world is None:
                self.drop("train_batch_size", "needs the world size to split: pass --hostfile (or set "
                                              "train.micro_batch_size and train.grad_accum_steps)")
            elif micro is not None:
                accum = total // (micro * self.world)
            elif accum is not None:
                micro = total // (accum * self.world)
            else:
                accum = 1
                micro = total // self.world
            if self.world is not None and (not micro or not accum or micro * accum * self.world != total):
                raise ZerorunError(f"train_batch_size: {total} is not micro-batch x accumulation x {self.world} "
                                   "ranks (the hostfile's slots)")
        elif total is not None and self.world is not None and micro * accum * self.world != total:
            raise ZerorunError(f"train_batch_size: {total} != train_micro_batch_size_per_gpu {micro} x "
                               f"gradient_accumulation_steps {accum} x {self.world} ranks (the hostfile's slots)")
        elif total is not None and self.world is None:  # no hostfile: the ranks it implies (passed over before)
            self._implied_ranks(total, micro, accum)
        if micro:
            train["micro_batch_size"] = micro
        else:  # DeepSpeed refuses a config without either; the placeholder 1 trained without a word
            self.fill_in.append("train.micro_batch_size: not in the config (train_micro_batch_size_per_gpu, or "
                                "train_batch_size with --hostfile): give --micro-batch-size or set it")
        if accum:
            train["grad_accum_steps"] = accum

    def _implied_ranks(self, total: int, micro: int, accum: int) -> None:
        """``train_batch_size`` beside a micro-batch and accumulation, no hostfile: the ranks they imply, under
        "Fill in" (the recipe trains on as many ranks as it is launched on).

        Raises:
            ZerorunError: ``total`` not a multiple of ``micro`` x ``accum`` (DeepSpeed asserts it for any world).
        """
        if total % (micro * accum):
            raise ZerorunError(f"train_batch_size: {total} is not train_micro_batch_size_per_gpu {micro} x "
                               f"gradient_accumulation_steps {accum} x a number of ranks (DeepSpeed refuses it too)")
        ranks = total // (micro * accum)
        self.fill_in.append(f"ranks: train_batch_size {total} is micro-batch {micro} x {accum} accumulation steps "
                            f"x {ranks} rank{'s' * (ranks != 1)}: train on {ranks} (zerorun train -H hostfile; or "
                            "import with --hostfile)")

    def zero(self, z: dict) -> None:
        out = self.recipe["zero"]
        if "stage" in z:
            stage = self.num("zero_optimization.stage", z.pop("stage"), int)
            if stage not in (0, 1, 2, 3):
                raise ZerorunError(f"zero_optimization.stage: {stage} is not a ZeRO stage (0-3)")
            out["stage"] = stage
        element = 4 if self.recipe.get("precision", "fp32") == "fp32" else 2
        if "reduce_bucket_size" in z:
            size = self.num("zero_optimization.reduce_bucket_size", z.pop("reduce_bucket_size"))
            if size:
                out["bucket_mb"] = round(size * element / 2**20, 3)
        if "stage3_param_persistence_threshold" in z:
            threshold = self.num("zero_optimization.stage3_param_persistence_threshold",
                                 z.pop("stage3_param_persistence_threshold"), int)
            if threshold and out.get("stage") == 3:
                out["persistence_threshold"] = threshold
            elif threshold:
                self.drop("zero_optimization.stage3_param_persistence_threshold", "stage 3 only")
        if "stage3_prefetch_bucket_size" in z:  # elements fetched ahead of use -> bytes (Note [Prefetch])
            size = self.num("zero_optimization.stage3_prefetch_bucket_size", z.pop("stage3_prefetch_bucket_size"),
                            int)
            if size is not None and size < 0:
                raise ZerorunError(f"zero_optimization.stage3_prefetch_bucket_size: expected >= 0 elements, got {size}")
            if size is not None and out.get("stage") == 3:
                out["prefetch_bytes"] = size * element
            elif size is not None:
                self.drop("zero_optimization.stage3_prefetch_bucket_size", "stage 3 only")
        offload = self.section("zero_optimization.offload_optimizer", z.pop("offload_optimizer", None))
        param = self.section("zero_optimization.offload_param", z.pop("offload_param", None))
        device, param_device = self.device("offload_optimizer", offload), self.device("offload_param", param)
        paths = {name: self.path(f"zero_optimization.{name}.nvme_path", section.get("nvme_path"))
                 for name, section, used in (("offload_optimizer", offload, device),
                                             ("offload_param", param, param_device))
                 if used == "nvme" and section.get("nvme_path") is not None}
        if device in ("cpu", "nvme"):
            out["offload_optimizer"] = "cpu" if device == "cpu" else "disk"
        for key in sorted(set(offload) - {"device", "nvme_path"}):
            if not (key == "pin_memory" and offload[key] is True):  # zerorun always pins on CUDA
                self.drop(f"zero_optimization.offload_optimizer.{key}", "no zerorun equivalent")
        if param_device == "nvme" and out.get("stage") == 3:  # was dropped as "not supported" (zero.offload_params)
            out["offload_params"] = "disk"
        elif param_device == "nvme":
            self.drop("zero_optimization.offload_param", "stage 3 only")
        elif param_device == "cpu":
            self.drop("zero_optimization.offload_param", "device cpu: zerorun offloads parameters to disk only "
                      "(zero.offload_params: disk at stage 3, paged through host memory); stage 3 keeps 1/N of them")
        for key in sorted(set(param) - {"device", "nvme_path"}) if out.get("offload_params") == "disk" else ():
            self.drop(f"zero_optimization.offload_param.{key}", "no zerorun equivalent")
        users = [name for name, used in (("offload_optimizer", device == "nvme"),
                                         ("offload_param", out.get("offload_params") == "disk")) if used]
        if users:  # one folder holds both swap files: the optimizer's path first, else the parameters'
            given = [paths[name] for name in users if name in paths]
            out["offload_path"] = given[0] if given else "/tmp/zerorun-swap"
            for name in users:
                if name in paths and paths[name] != out["offload_path"]:
                    self.drop(f"zero_optimization.{name}.nvme_path", "one folder holds both swap files here: "
                              f"zero.offload_path is {out['offload_path']}")
        zero_plus_plus(self, z, out)
        for key in sorted(z):  # an "always on" set true is what zerorun does: not listed
            if not (z[key] is True and ALWAYS.get(key, "").startswith("always on")):
                self.drop(f"zero_optimization.{key}", ALWAYS.get(key, "no zerorun equivalent"))

    def optimizer(self, opt: Any) -> None:
        opt = self.section("optimizer", opt)
        if not opt:
            return
        kind = str(opt.get("type", "")).lower()
        params = dict(self.section("optimizer.params", opt.get("params")))
        adam_w = self.flag("optimizer.params.adam_w_mode", params.pop("adam_w_mode")) \
            if kind == "adam" and "adam_w_mode" in params else True  # "false" (text) was AdamW
        names = {"adam": "AdamW" if adam_w is not False else "Adam", "adamw": "AdamW", "sgd": "SGD",
                 "adagrad": "Adagrad"}
        if kind not in names:
            self.drop("optimizer", f"type {opt.get('type')!r}: use a torch.optim class in train.optimizer.name")
            return
        out: dict[str, Any] = {"name": names[kind]}
        for key, kind_of in CARRIED[out["name"]].items():
            if key in params:
                field, value = f"optimizer.params.{key}", params.pop(key)
                value = self.flag(field, value) if kind_of is bool else self.num(field, value)
                if value is not None:
                    out[key] = value
        if "betas" in params and out["name"] in ("Adam", "AdamW"):  # SGD, Adagrad: listed as not an argument
            betas = params.pop("betas")
            if betas == "auto":
                self.num("optimizer.params.betas", betas)  # listed as dropped, as every 'auto'
            elif not isinstance(betas, list) or len(betas) != 2:  # a string failed without naming the field
                raise ZerorunError(f"optimizer.params.betas: expected a list of two numbers, got {betas!r}")
            elif "auto" in betas:  # an 'auto' item wrote null into the recipe
                self.drop("optimizer.params.betas", f"{betas!r} has an 'auto' item (filled in by the HF Trainer "
                                                    "integration): set both in the recipe")
            else:  # float(True) was 1.0
                out["betas"] = [self.num(f"optimizer.params.betas.{i}", b) for i, b in enumerate(betas)]
        for key in sorted(params):  # amsgrad, nesterov were listed as "no torch.optim equivalent"
            self.drop(f"optimizer.params.{key}", not_carried(key, out["name"]))
        self.recipe["train"]["optimizer"] = out


def import_deepspeed(path: str, hostfile: str | None = None, **given: Any) -> tuple[str, list[str], list[str]]:
    """``(recipe YAML text, dropped fields as "field: reason", what to fill in)`` for DeepSpeed config ``path``.
    The YAML starts with comments naming the source, what to fill in (``model`` and ``data`` are placeholders),
    the HF Trainer ``"auto"`` values taken as defaults and every dropped field.

    ``hostfile`` (DeepSpeed's format): its slots give the world size (to split ``train_batch_size``) and
    ``launch.procs_per_node`` (the first host's slots). ``given``: ``lr``, ``steps``, ``micro_batch_size`` (the
    command line's, None when not given), for the config's ``"auto"`` (Note [HF Trainer auto]).

    Raises:
        ZerorunError: unreadable file, not JSON, a field of the wrong type, a batch size that does not split,
            an option beside a different number in the config; one line naming the file and the field.
    """
    from zerorun.recipe import read_text

    check_options(given)
    ds = parse_config(path, read_text(path, "DeepSpeed config"))
    world = procs = None
    if hostfile:
        from zerorun.recipe.hostfile import read_hostfile

        hosts = read_hostfile(hostfile)
        world, procs = sum(h.slots for h in hosts), hosts[0].slots
    try:
        hf_config = has_auto(ds)  # written for the HF Trainer, which fills its "auto" values
        ds, notes, fill_in = resolve_auto(ds, given)
        if hf_config and not ds.get("scheduler"):  # Note [DeepSpeed's schedules]
            notes.append("scheduler: none, so the HF Trainer's own (lr_scheduler_type linear, warmup_steps 0): "
                         "linear decay to 0")
        imp = _Import(ds, world, given, hf_config)
        recipe = imp.run()
    except ZerorunError as e:
        raise ZerorunError(f"{path}: {e}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise ZerorunError(f"{path}: a field has an unexpected value: {e}") from None
    if procs:
        recipe["launch"] = {"procs_per_node": procs}
    if given.get("steps") is None and not imp.steps_known and not any(f.startswith("train.steps:") for f in fill_in):
        # 'auto' for the HF Trainer's config; a plain one's 1000-step placeholder was not named (a review)
        (fill_in if hf_config else imp.fill_in).append(
            "train.steps: not in the config (a scheduler's total_num_steps, the HF Trainer's max_steps or "
            "num_train_epochs): give --steps or set it")
    mark_fill_in(recipe, fill_in)  # the HF Trainer's 'auto' values; the placeholders below stay loadable
    fill_in += [line for line in imp.fill_in if not any(f.split(":")[0] == line.split(":")[0] for f in fill_in)]
    fill_in = ["model, data: placeholders (a model module or model.hf; your data)"] + fill_in
    head = [f"# Imported from {path} by zerorun import-deepspeed" + (f" (hostfile {hostfile})" if hostfile else ""),
            "# Fill in, then: zerorun train recipe.yaml" + (f" -H {hostfile}" if hostfile else "")]
    head += [f"#   {line}" for line in fill_in]
    for title, lines in (("# 'auto' taken as the HF Trainer's defaults (change any your TrainingArguments set):",
                          notes), ("# Dropped DeepSpeed fields:", imp.dropped)):
        head += [title] + [f"#   {line}" for line in lines] if lines else []
    body = yaml.safe_dump(recipe, sort_keys=False, default_flow_style=None, width=110)
    return "\n".join(head) + "\n" + body, imp.dropped, fill_in

