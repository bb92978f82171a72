"""The learning-rate schedule of a recipe (``train.schedule``) and what resuming does to it.

Note [LR schedule on resume]: the schedule is a function of the step and of the recipe the job is given
(``train.steps``, ``train.schedule``), recomputed on every start. A resumed job's LR at every step after the
saved one is exactly the LR an uninterrupted run of *its* recipe has at that step, times the checkpoint's base
LR (the optimizer's param-group options come from the checkpoint). With the recipe unchanged that is the
uninterrupted run itself, bit for bit. With ``train.steps`` raised (400 -> 600, resumed after step 400) the
warm-up and the decay are those of a 600-step run: the LR of step 401 is the 600-step schedule's at step 401,
so a cosine schedule that had decayed to ``min_lr_ratio`` at step 400 goes back up to where a 600-step run is
(the launcher prints both values; warm-up is not repeated unless ``warmup_steps`` lies beyond the saved step).
Before this rule the first resumed step kept the saved LR (the old schedule's) and only the steps after it took
the new one.
"""

from __future__ import annotations

import math
from typing import Callable


def lr_multiplier(spec, steps: int) -> Callable[[int], float]:
    """``f(step) -> multiplier of the base lr`` for the recipe's ``train.schedule`` ``spec`` (a
    :class:`~zerorun.recipe.ScheduleSpec`) over ``steps`` optimizer steps; ``step`` counts from 0 (the LR of
    optimizer step ``k``, 1-based, is ``base * f(k - 1)``): linear warm-up from ``1/warmup_steps`` to 1 over
    ``warmup_steps``, then cosine or linear decay to ``min_lr_ratio`` at step ``steps - 1``, or constant."""

    def f(step: int) -> float:
        if step < spec.warmup_steps:
            return (step + 1) / spec.warmup_steps
        if spec.decay == "constant":
            return 1.0
        progress = min(1.0, (step - spec.warmup_steps) / max(1, steps - 1 - spec.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if spec.decay == "cosine" else 1 - progress
        return spec.min_lr_ratio + (1 - spec.min_lr_ratio) * shape

    return f


def continue_schedule(scheduler) -> list[float]:
    """After ``scheduler`` (a ``torch.optim.lr_scheduler.LambdaLR`` built over this run's
    :func:`lr_multiplier`) and its optimizer's param groups were restored from a checkpoint: set every param
    group's ``lr`` to its base LR times this run's multiplier at the restored step, as the uninterrupted run
    would have it (Note [LR schedule on resume]). The checkpoint holds the LR its own schedule gave, which is
    another one when ``train.steps`` or ``train.schedule`` changed.

    Returns:
        The LRs set, one per param group (float).
    """
    lrs = [base * f(scheduler.last_epoch) for base, f in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = list(lrs)  # what get_last_lr() reports, as LambdaLR.step() leaves it
    return lrs
