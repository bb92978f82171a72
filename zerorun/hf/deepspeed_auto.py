"""``zerorun import-deepspeed`` on the configs Hugging Face Trainer users have: every value ``"auto"``, and the
monitor sections (``tensorboard``, ``wandb``, ``csv_monitor``, ``comet``).

Note [HF Trainer auto]: the HF Trainer fills each ``"auto"`` of a DeepSpeed config from its ``TrainingArguments``
(``transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig``) before DeepSpeed reads it. zerorun has no
TrainingArguments, so :func:`resolve_auto` fills them before the mapping of ``deepspeed.py`` runs, from three
places: (1) the command line, for the three values every job sets (``--lr`` the Trainer's ``learning_rate``,
``--steps`` its ``max_steps``, ``--micro-batch-size`` its ``per_device_train_batch_size``); one given beside a
different number in the config is an error, as the Trainer's mismatch check is; (2) the Trainer's defaults,
for the values most jobs leave at them (``gradient_accumulation_steps`` 1, ``max_grad_norm`` 1.0, Adam's
betas (0.9, 0.999), eps 1e-8, ``weight_decay`` 0, warm-up 0 steps, fp16/bf16 off), each written as a comment
so a job that changed one sees where to change it; (3) zerorun's own defaults for what the Trainer derives from
the model (``reduce_bucket_size``, ``stage3_prefetch_bucket_size``, ``stage3_param_persistence_threshold`` from
its hidden size). What (1) does not give is listed at the top of the recipe under "Fill in", with the
placeholders (model, data) that every imported recipe has; ``train_batch_size`` is derived (micro-batch x
accumulation x ranks), as the Trainer derives it.
"""

from __future__ import annotations

import copy
import math
import os
from typing import Any

from zerorun.errors import ZerorunError

AUTO = "auto"
#: (section path, key) -> (the HF Trainer's default, the TrainingArguments field it comes from)
HF_DEFAULTS = {((), "gradient_accumulation_steps"): (1, "gradient_accumulation_steps"),
               ((), "gradient_clipping"): (1.0, "max_grad_norm"),
               (("optimizer", "params"), "betas"): ([0.9, 0.999], "adam_beta1, adam_beta2"),
               (("optimizer", "params"), "eps"): (1e-8, "adam_epsilon"),
               (("optimizer", "params"), "weight_decay"): (0.0, "weight_decay"),
               (("scheduler", "params"), "warmup_num_steps"): (0, "warmup_steps")}
#: zero_optimization keys the Trainer sets from the model's hidden size
MODEL_SIZED = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold")
#: option -> ((section path, key) it fills, the recipe field, the TrainingArguments field)
OPTIONS = {"lr": ([(("optimizer", "params"), "lr"), (("scheduler", "params"), "warmup_max_lr")],
                  "train.optimizer.lr", "learning_rate"),
           "steps": ([(("scheduler", "params"), "total_num_steps")], "train.steps", "max_steps"),
           "micro_batch_size": ([((), "train_micro_batch_size_per_gpu")], "train.micro_batch_size",
                                "per_device_train_batch_size")}


def has_auto(value: Any) -> bool:
    """Whether a DeepSpeed config (or any value in it) holds an ``"auto"``: it was written for the HF Trainer."""
    if isinstance(value, dict):
        return any(has_auto(v) for v in value.values())
    if isinstance(value, list):
        return any(has_auto(v) for v in value)
    return value == AUTO


def check_options(given: dict[str, Any]) -> None:
    """Raises ZerorunError: ``--lr`` not a finite number > 0 (typer takes nan, inf and 0 as floats)."""
    lr = given.get("lr")
    if lr is not None and not (math.isfinite(lr) and lr > 0):
        raise ZerorunError(f"--lr: expected a learning rate > 0, got {lr}")


def _section(ds: dict, path: tuple[str, ...]) -> dict | None:
    """The mapping at ``path`` in ``ds`` (None when absent or not a mapping: the mapping's own checks say so)."""
    for key in path:
        ds = ds.get(key) if isinstance(ds, dict) else None
    return ds if isinstance(ds, dict) else None


def _flag(option: str) -> str:
    return "--" + option.replace("_", "-")


def _options(ds: dict, given: dict[str, Any], fill_in: list[str]) -> None:
    """(1) of Note [HF Trainer auto]: fill each 'auto' (or absent) field an option stands for with the option,
    or list it under "Fill in" when the option is not given."""
    for option, (places, field, hf) in OPTIONS.items():
        value, auto = given.get(option), False
        if value is None:  # a number the config gives in one place (warmup_max_lr) fills the others' 'auto'
            known = [s[k] for p, k in places if (s := _section(ds, p)) is not None and s.get(k, AUTO) != AUTO]
            value = known[0] if known else None
        for path, key in places:
            section = _section(ds, path)
            if not path and key not in ds and value is not None:
                ds[key] = value  # the micro-batch: the Trainer sets it whether or not the config names it
            if section is None or key not in section:
                continue
            if section[key] == AUTO:
                auto = True
                if value is None:
                    del section[key]
                else:
                    section[key] = value
            elif given.get(option) is not None and section[key] != value:
                raise ZerorunError(f"{'.'.join((*path, key))}: {section[key]!r} in the config and {_flag(option)} "
                                   f"{value}: give one")
        if auto and value is None:
            fill_in.append(f"{field}: 'auto' in the config (the HF Trainer's {hf}): give {_flag(option)} or set it")


def _precision(ds: dict, notes: list[str]) -> None:
    """fp16/bf16 ``enabled: auto``: off (the Trainer's default), and fp16's loss-scale fields with it, one note."""
    autos = [name for name in ("fp16", "bf16") if isinstance(ds.get(name), dict) and ds[name].get("enabled") == AUTO]
    for name in autos:
        ds[name] = {"enabled": False}  # the loss-scale fields go with it: zerorun refuses them without fp16
    if autos:
        notes.append(f"{' and '.join(f'{n}.enabled' for n in autos)}: fp32 (the HF Trainer's default; set "
                     "precision: bf16, or fp16 and its loss_scale, if your TrainingArguments set bf16/fp16)")


def resolve_auto(ds: dict, given: dict[str, Any]) -> tuple[dict, list[str], list[str]]:
    """Fill the ``"auto"`` values of DeepSpeed config ``ds`` (Note [HF Trainer auto]). ``given``: the options
    ``lr``, ``steps``, ``micro_batch_size`` (None when not given).

    Returns:
        ``(config without the auto values filled or left out, notes: "field: value (why)" for each value
        taken as a default, fill_in: what the user must still give)``.

    Raises:
        ZerorunError: an option beside a different number in the config.
    """
    ds, notes, fill_in = copy.deepcopy(ds), [], []
    _options(ds, given, fill_in)
    if ds.get("train_batch_size") == AUTO:
        del ds["train_batch_size"]  # micro-batch x accumulation x ranks, as the Trainer derives it
    for (path, key), (value, hf) in HF_DEFAULTS.items():
        section = _section(ds, path)
        if section is not None and section.get(key) == AUTO:
            section[key] = value
            notes.append(f"{'.'.join((*path, key))}: {value} (the HF Trainer's default {hf})")
    sched = _section(ds, ("scheduler", "params"))
    if sched is not None and sched.get("warmup_min_lr") == AUTO:
        del sched["warmup_min_lr"]  # the Trainer's 0: zerorun's warm-up starts at lr / warmup_steps
    zero = _section(ds, ("zero_optimization",))
    sized = [key for key in MODEL_SIZED if zero is not None and zero.get(key) == AUTO]
    for key in sized:
        del zero[key]
    if sized:
        notes.append(f"zero_optimization.{', '.join(sized)}: zerorun's defaults (the HF Trainer sizes them from "
                     "the model's hidden size)")
    _precision(ds, notes)
    return ds, notes, fill_in


def monitors(ds: dict, drop) -> dict[str, Any]:
    """DeepSpeed's monitor sections popped from ``ds`` as the recipe's ``log`` fields (``trackers`` and their
    settings); ``drop(field, why)`` for what has no equivalent. A section with ``enabled`` not true is left out."""
    log: dict[str, Any] = {"trackers": []}
    for name, tracker in (("tensorboard", "tensorboard"), ("wandb", "wandb"), ("csv_monitor", "csv"),
                          ("comet", None)):
        section = ds.pop(name, None)
        if not isinstance(section, dict) or section.get("enabled") is not True:
            continue
        rest = {k: v for k, v in section.items() if k != "enabled"}
        if tracker is None:
            drop(name, "not supported (log.trackers has tensorboard, wandb, mlflow, csv)")
            continue
        log["trackers"].append(tracker)
        if name == "tensorboard" and rest.get("output_path"):
            log["tensorboard"] = {"dir": os.path.join(rest.pop("output_path"), rest.pop("job_name", ""))}
        elif name == "wandb":
            spec = {key: rest.pop(ds_key) for ds_key, key in (("project", "project"), ("team", "entity"))
                    if rest.get(ds_key) is not None}
            if spec:
                log["wandb"] = spec
        for key in sorted(rest):
            drop(f"{name}.{key}", "zerorun writes metrics.csv in the run folder" if tracker == "csv"
                 else "no zerorun equivalent (runs are named after the run folder)")
    if not log["trackers"]:
        del log["trackers"]
    return log


def mark_fill_in(recipe: dict, fill_in: list[str]) -> None:
    """Write ``auto`` at each ``train.*`` field of ``fill_in`` ("field: why" lines), so that the recipe does not
    load until it is filled in (as the HF Trainer refuses a DeepSpeed config whose 'auto' it cannot fill):
    zerorun's defaults (lr 3e-4, micro-batch 1, 1000 steps) would otherwise train silently in their place."""
    for line in fill_in:
        field = line.split(":", 1)[0]
        if not field.startswith("train."):
            continue
        *parents, key = field.split(".")
        section = recipe
        for name in parents:
            section = section.setdefault(name, {})
        section[key] = AUTO
