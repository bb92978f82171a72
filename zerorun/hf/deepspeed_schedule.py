"""``zerorun import-deepspeed``: the learning rate a DeepSpeed job trains at, as the recipe's ``train.schedule``.

Note [DeepSpeed's schedules]: what the LR of a DeepSpeed job is at each step, and the recipe that comes closest
(DeepSpeed's ``deepspeed/runtime/lr_schedules.py``; the defaults in brackets apply where the config leaves a
field out, and were missed before a review: the recipe trained at zerorun's cosine default instead).

- No ``scheduler``: DeepSpeed keeps the optimizer's LR constant (``decay: constant``). A config written for the
  HF Trainer (one with ``"auto"`` values) gets the Trainer's own scheduler instead, ``lr_scheduler_type``
  linear by default: linear decay to 0 after ``warmup_steps`` (0).
- ``WarmupLR`` and ``WarmupDecayLR`` set the LR themselves, from ``warmup_min_lr`` (0) to ``warmup_max_lr``
  (0.001) over ``warmup_num_steps`` (1000): the optimizer's own ``lr`` is not used. ``WarmupCosineLR`` scales
  the optimizer's LR from ``warmup_min_ratio`` (0), then decays by cosine to ``cos_min_ratio`` (0.0001).
- Warm-up: DeepSpeed's ``warmup_type`` is ``log`` unless set (LR in proportion to log(i + 1) / log(W)), and its
  linear one starts at ``warmup_min_lr``; zerorun's warm-up is linear from lr / W. Named under "Dropped" where
  the recipe has a warm-up.
- Linear decay: DeepSpeed's multiplier (and the HF Trainer's) at optimizer step i, counted from 0, is
  (T - i) / (T - W) for T ``total_num_steps``, 1 / (T - W) at the last step; zerorun's linear decay reaches
  ``min_lr_ratio`` at its last step, so ``min_lr_ratio: 1 / (T - W)`` gives DeepSpeed's multiplier at every
  step after the warm-up. When T is not known at import (``train.steps`` to fill in) it is 0: the LR reaches 0
  one step early.
"""

from __future__ import annotations

from typing import Any

#: DeepSpeed's defaults of its schedulers' params (deepspeed/runtime/lr_schedules.py)
DS_WARMUP_STEPS, DS_MAX_LR, DS_COS_MIN_RATIO = 1000, 0.001, 0.0001
KINDS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


def map_scheduler(imp, sched: Any, hf_config: bool) -> None:
    """Write ``imp.recipe``'s ``train.schedule`` (and the LR a ``WarmupLR``/``WarmupDecayLR`` sets, and
    ``train.steps`` from ``total_num_steps``) for DeepSpeed's ``scheduler`` section ``sched`` (Note
    [DeepSpeed's schedules]). ``imp``: the import (``deepspeed._Import``: ``section``, ``num``, ``drop``);
    ``hf_config``: the config has ``"auto"`` values (the HF Trainer's, whose default schedule is linear).
    :func:`finish_schedule` completes it once ``train.steps`` is known.

    Raises:
        ZerorunError: a field of the wrong type (from ``imp.num``/``imp.section``).
    """
    sched = imp.section("scheduler", sched)
    train = imp.recipe["train"]
    if not sched:
        train["schedule"] = ({"decay": "linear", "min_lr_ratio": "to_zero"} if hf_config
                             else {"decay": "constant"})
        return
    kind = sched.get("type")
    if kind not in KINDS:
        imp.drop("scheduler", f"type {kind!r}: the recipe keeps the LR constant (train.schedule has linear "
                              "warm-up, then cosine, linear or constant)")
        train["schedule"] = {"decay": "constant"}
        return
    p = dict(imp.section("scheduler.params", sched.get("params")))
    given = set(p)
    warmup = imp.num("scheduler.params.warmup_num_steps", p.pop("warmup_num_steps", DS_WARMUP_STEPS), int)
    schedule: dict[str, Any] = {"warmup_steps": warmup}
    if "total_num_steps" in p:
        steps = imp.num("scheduler.params.total_num_steps", p.pop("total_num_steps"), int)
        if steps:
            train["steps"] = imp.steps_known = steps
    if kind == "WarmupCosineLR":
        schedule.update(decay="cosine", min_lr_ratio=imp.num("scheduler.params.cos_min_ratio",
                                                             p.pop("cos_min_ratio", DS_COS_MIN_RATIO)))
        floor = ("warmup_min_ratio",)
    else:
        max_lr = imp.num("scheduler.params.warmup_max_lr", p.pop("warmup_max_lr", DS_MAX_LR))
        if max_lr:  # None: 'auto' (listed as dropped)
            opt = train.setdefault("optimizer", {"name": "AdamW"})
            if opt.get("lr") not in (None, max_lr):
                default = "" if "warmup_max_lr" in given else ", DeepSpeed's default"
                imp.drop("optimizer.params.lr", f"{opt['lr']}: {kind} sets the LR itself (warmup_max_lr {max_lr}"
                                                f"{default})")
            opt["lr"] = max_lr
        schedule.update({"decay": "constant"} if kind == "WarmupLR" else {"decay": "linear", "min_lr_ratio": "to_zero"})
        floor = ("warmup_min_lr",)
    for key in floor:
        if p.pop(key, 0):
            imp.drop(f"scheduler.params.{key}", "zerorun's warm-up starts at lr/warmup_steps")
    shape = p.pop("warmup_type", "log")
    if warmup and shape != "linear":
        default = "" if "warmup_type" in given else " (DeepSpeed's default)"
        imp.drop("scheduler.params.warmup_type", f"{shape}{default}: zerorun's warm-up is linear, from "
                                                 "lr/warmup_steps")
    for key in sorted(p):
        imp.drop(f"scheduler.params.{key}", "no zerorun equivalent")
    train["schedule"] = {k: v for k, v in schedule.items() if v is not None}  # 'auto': listed, left out


def finish_schedule(recipe: dict, steps_known: int) -> None:
    """Set a linear decay to 0 after the last step (``min_lr_ratio: "to_zero"`` from :func:`map_scheduler`) to
    DeepSpeed's multiplier at the last step, 1 / (T - W), once T (``train.steps``) is known; else 0 (Note
    [DeepSpeed's schedules])."""
    schedule = recipe["train"].get("schedule", {})
    if schedule.get("min_lr_ratio") == "to_zero":
        left = steps_known - schedule.get("warmup_steps", 0)
        schedule["min_lr_ratio"] = 1.0 / left if steps_known and left > 1 else 0.0
