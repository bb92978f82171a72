"""``engine.optimizer`` used as a plain torch optimizer: what it refuses.

Note [The engine's optimizer]: ``engine.optimizer`` is the user's ``torch.optim`` class, built over this rank's
fp32 master segments (one 1-D tensor per parameter range of each flat buffer this rank steps: Note [One
optimizer step] in masters.py), not over the model's parameters, so that LR schedulers and hand-set ``lr``,
``weight_decay`` or ``betas`` work as in plain PyTorch. Two other torch habits went wrong on it, silently (found
by review):

- ``add_param_group`` with the model's parameters (a new learning rate for a layer after ``initialize``) was
  accepted: at stage 0 those parameters were then stepped twice per step (the masters are views of the same
  storage), at stages 1-3 the group was ignored (its parameters get no ``.grad``). It raises, naming
  ``initialize``'s ``param_groups``.
- ``load_state_dict`` of another rank's state (a DDP checkpoint habit: rank 0's ``state_dict()`` loaded on every
  rank) or of a plain torch run's was accepted: at stages 1-3 rank 1 stepped with rank 0's moments (0.12 off
  after 3 steps), and where the slices' sizes differ one rank failed with a bare size error in its next step
  while the others waited in a collective. So ``state_dict()`` carries a ``"zerorun"`` entry (rank, world size,
  stage, the segments' sizes), and ``load_state_dict`` checks it on every rank together (one host agreement: it
  is collective, as ``zerorun.checkpoint.load``), raising on every rank where any rank's state is not the one it
  saved itself. Each rank's own state loads as torch loads it (the same world size and stage; at stage 0, whose
  ranks all hold the same whole state, any rank's, as under DDP); ``zerorun.checkpoint`` resumes at any.
"""

from __future__ import annotations

from typing import Any

import torch

_KEY = "zerorun"


def guard(optimizer: torch.optim.Optimizer, comm, stage: int) -> None:
    """Make ``optimizer`` (an engine's, over this rank's master segments) refuse ``add_param_group`` and check
    the states it loads (Note [The engine's optimizer]); ``comm``: the engine's Comm."""
    mine = {"rank": comm.rank, "world_size": comm.world_size, "stage": stage,
            "numels": [p.numel() for g in optimizer.param_groups for p in g["params"]]}

    def refuse(group: dict[str, Any]) -> None:
        raise RuntimeError(
            "engine.optimizer.add_param_group: the engine's optimizer steps this rank's fp32 master slices, not the "
            "model's parameters, so a group added after zerorun.initialize would be stepped twice (stage 0) or "
            "never (stages 1-3); pass every group to initialize(param_groups=[...]) (a group to train later can "
            "start with lr 0)")

    def tag(opt, state: dict) -> dict:
        return {**state, _KEY: dict(mine)}

    def check(opt, state: dict) -> dict:
        state = dict(state)
        theirs = state.pop(_KEY, None)
        problem = _problem(theirs, mine)
        if comm.agree([int(problem is not None)])[0]:
            raise RuntimeError(f"engine.optimizer.load_state_dict: {problem or 'another rank could not load its state'}"
                               ": the engine's optimizer holds this rank's slice of the fp32 masters, so each rank "
                               "loads the state it saved itself (engine.optimizer.state_dict() there, the same world "
                               "size and stage); zerorun.checkpoint.save / load resume at any (nothing was loaded)")
        return state

    optimizer.add_param_group = refuse
    optimizer.register_state_dict_post_hook(tag)
    optimizer.register_load_state_dict_pre_hook(check)


def _problem(theirs: dict | None, mine: dict) -> str | None:
    """Why the state described by ``theirs`` (its ``"zerorun"`` entry; ``None``: none) is not this rank's, or
    ``None``."""
    if theirs is None:
        return "the state was not saved by a zerorun engine's optimizer (a plain torch optimizer's holds whole "\
               "parameters)"
    keys = ("stage", "numels") if mine["stage"] == 0 else tuple(mine)  # stage 0: every rank's state is the same
    if all(theirs.get(k) == mine[k] for k in keys):
        return None
    same = all(theirs.get(k) == mine[k] for k in ("rank", "world_size", "stage"))
    return (f"the state was saved by rank {theirs.get('rank')} of {theirs.get('world_size')} at stage "
            f"{theirs.get('stage')}, and this is rank {mine['rank']} of {mine['world_size']} at stage {mine['stage']}"
            + (" (over other parameter slices: another model, param groups or bucket size)" if same else ""))
