"""``zerorun import-deepspeed``: the learning rate a DeepSpeed job trains at, as the recipe's ``train.schedule``.

Note [DeepSpeed's schedules]: what the LR of a DeepSpeed job is at each optimizer step, and the recipe that comes
closest (DeepSpeed's ``deepspeed/runtime/lr_schedules.py``; the defaults in brackets apply where the config
leaves a field out, and were missed before a review: the recipe trained at zerorun's cosine default instead).

- No ``scheduler``: DeepSpeed keeps the optimizer's LR constant (``decay: constant``). A config written for the
  HF Trainer (one with ``"auto"`` values) gets the Trainer's own scheduler instead, ``lr_scheduler_type``
  linear by default, warm-up 0: lr (T - k) / T at optimizer step k from 0, which ``min_lr_ratio: 1 / T`` gives.
- ``WarmupLR`` and ``WarmupDecayLR`` set the LR themselves, from ``warmup_min_lr`` (0) to ``warmup_max_lr``
  (0.001) over W = max(2, ``warmup_num_steps`` (1000)) iterations (DeepSpeed's floor; from 0.19.6 it refuses
  0 and below, which the recipe takes as 2), then (``WarmupDecayLR``) down towards
  ``warmup_min_lr`` at ``total_num_steps`` T: the optimizer's own ``lr`` is not used. ``WarmupCosineLR``
  scales the optimizer's LR from ``warmup_min_ratio`` (0), then decays by cosine to ``cos_min_ratio`` (0.0001).
- One step behind: DeepSpeed's engine steps its scheduler after each optimizer step, and the scheduler sets its
  iteration -1 value (``warmup_min_lr``) when made, so optimizer step k trains at iteration k - 1. The recipe's
  warm-up is therefore W + 1 steps; after it, ``WarmupDecayLR``'s LR, m + (1 - m) (T - k + 1) / (T - W) for
  m = ``warmup_min_lr`` / ``warmup_max_lr``, is zerorun's linear decay to ``min_lr_ratio`` m + (1 - m) 2 /
  (T - W) at the last step, exactly (the review's table found it a step early). The cosine reaches
  ``cos_min_ratio`` at the last step where DeepSpeed's would one step later.
- Warm-up: DeepSpeed's ``warmup_type`` is ``log`` unless set (LR in proportion to log(i + 1) / log(W)), and it
  starts at ``warmup_min_lr``; zerorun's warm-up is linear from lr / W (with ``warmup_type: linear`` it reaches
  the peak one step before DeepSpeed's, whose log warm-up reaches it a step early too). Both are named under
  "Dropped". With
  ``warmup_min_lr`` equal to ``warmup_max_lr`` (DeepSpeed's way to a constant LR) the recipe has no warm-up.
"""

from __future__ import annotations

from typing import Any

#: DeepSpeed's defaults of its schedulers' params (deepspeed/runtime/lr_schedules.py)
DS_WARMUP_STEPS, DS_MAX_LR, DS_COS_MIN_RATIO = 1000, 0.001, 0.0001
KINDS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


def map_scheduler(imp, sched: Any) -> tuple[float, int, int] | None:
    """Write ``imp.recipe``'s ``train.schedule`` (and the LR a ``WarmupLR``/``WarmupDecayLR`` sets, and
    ``train.steps`` from ``total_num_steps``) for DeepSpeed's ``scheduler`` section ``sched`` (Note
    [DeepSpeed's schedules]). ``imp``: the import (``deepspeed._Import``: ``section``, ``num``, ``drop``, and
    ``hf_config``: the config has ``"auto"`` values, the HF Trainer's, whose default schedule is linear).

    Returns:
        For a linear decay, ``(floor, warm-up, lag)`` for :func:`finish_schedule`, which sets ``min_lr_ratio``
        once ``train.steps`` is known; else None.

    Raises:
        ZerorunError: a field of the wrong type (from ``imp.num``/``imp.section``).
    """
    sched, hf_config = imp.section("scheduler", sched), imp.hf_config
    train = imp.recipe["train"]
    if not sched or sched.get("type") not in KINDS:
        if sched:
            imp.drop("scheduler", f"type {sched.get('type')!r}: the recipe keeps the LR constant (train.schedule has "
                                  "linear warm-up, then cosine, linear or constant)")
        train["schedule"] = {"decay": "linear" if hf_config and not sched else "constant"}
        return (0.0, 0, 1) if hf_config and not sched else None  # the HF Trainer's: (T - k) / T
    kind, p = sched["type"], dict(imp.section("scheduler.params", sched.get("params")))
    given = set(p)
    warmup = imp.num("scheduler.params.warmup_num_steps", p.pop("warmup_num_steps", DS_WARMUP_STEPS), int)
    warmup = None if warmup is None else max(2, warmup)  # DeepSpeed's own floor (-5 wrote a recipe that failed)
    if "total_num_steps" in p:
        steps = imp.num("scheduler.params.total_num_steps", p.pop("total_num_steps"), int)
        if steps:
            train["steps"] = imp.steps_known = steps
    if kind == "WarmupCosineLR":
        ratio = imp.num("scheduler.params.cos_min_ratio", p.pop("cos_min_ratio", DS_COS_MIN_RATIO))
        schedule, floor, end = {"decay": "cosine", "min_lr_ratio": ratio}, ("warmup_min_ratio",), None
    else:
        floor, low = ("warmup_min_lr",), imp.num("scheduler.params.warmup_min_lr", p.get("warmup_min_lr", 0.0))
        max_lr = _set_lr(imp, kind, p.pop("warmup_max_lr", DS_MAX_LR), "warmup_max_lr" in given)
        low = low / max_lr if max_lr and low else 0.0
        schedule = {"decay": "constant" if kind == "WarmupLR" else "linear"}
        end = (low, warmup, 2) if kind == "WarmupDecayLR" and warmup is not None else None
        if low == 1.0:  # warmup_min_lr == warmup_max_lr: DeepSpeed's constant LR
            warmup, floor = 0, ()
            p.pop("warmup_min_lr")
    schedule["warmup_steps"] = None if warmup is None else warmup + 1 if warmup else 0  # the engine's lag
    for key in floor:
        if p.pop(key, 0):
            imp.drop(f"scheduler.params.{key}", "zerorun's warm-up starts at lr/warmup_steps (a decay ends at it)")
    shape = p.pop("warmup_type", "log")
    if warmup and shape != "linear":
        default = "" if "warmup_type" in given else " (DeepSpeed's default)"
        imp.drop("scheduler.params.warmup_type", f"{shape}{default}: zerorun's warm-up is linear, from "
                                                 "lr/warmup_steps")
    for key in sorted(p):
        imp.drop(f"scheduler.params.{key}", "no zerorun equivalent")
    train["schedule"] = {k: v for k, v in schedule.items() if v is not None}  # 'auto': listed, left out
    return end


def _set_lr(imp, kind: str, value: Any, given: bool) -> float | None:
    """``WarmupLR``/``WarmupDecayLR`` set the LR to ``warmup_max_lr`` (``value``; ``given``: in the config, else
    DeepSpeed's default) whatever the optimizer's: the recipe's ``train.optimizer.lr``. None for 'auto'."""
    max_lr = imp.num("scheduler.params.warmup_max_lr", value)
    if max_lr:  # None: 'auto' (listed as dropped)
        opt = imp.recipe["train"].setdefault("optimizer", {"name": "AdamW"})
        if opt.get("lr") not in (None, max_lr):
            imp.drop("optimizer.params.lr", f"{opt['lr']}: {kind} sets the LR itself (warmup_max_lr {max_lr}"
                                            f"{'' if given else ', DeepSpeed default'})")
        opt["lr"] = max_lr
    return max_lr


def finish_schedule(recipe: dict, steps_known: int, end: tuple[float, int, int] | None) -> None:
    """Set a linear decay's ``min_lr_ratio`` to the multiplier DeepSpeed's (or the HF Trainer's) schedule has
    at the last step (Note [DeepSpeed's schedules]): ``end`` ``(floor m, warm-up W, lag d)`` gives m + (1 - m)
    d / (T - W) for T ``train.steps`` when known, else m (the decay then reaches its floor one step early)."""
    if end is None:
        return
    floor, warmup, lag = end
    left = steps_known - warmup
    recipe["train"]["schedule"]["min_lr_ratio"] = floor + (1 - floor) * lag / left if steps_known and left > lag \
        else floor
