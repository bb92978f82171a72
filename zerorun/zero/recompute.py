"""Activation checkpointing of stage 3's listed units: a unit's forward recomputed in backward as its first run
left it (Note [Recomputed as first run])."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

from zerorun.zero.torch_internals import in_backward


# Note [Recomputed as first run]: ``ZeroConfig.activation_checkpointing`` recomputes each listed unit's forward in
# backward (``torch.utils.checkpoint``, non-reentrant, which restores the RNG: dropout draws the same mask). A
# forward that changes the unit's buffers (BatchNorm's running statistics and ``num_batches_tracked``, a decaying
# gate kept as a buffer) ran twice under torch's checkpoint: the statistics were updated twice (the count 6 after 3
# steps), and the recomputation read the buffers as the first run left them, so the gradients differed from stage
# 0's from the first step. Here the recomputation runs on copies of the buffers as the first run found them, and the
# module's own buffers are put back after it: the statistics are updated once and the gradients are stage 0's.
# Which buffers a call changed cannot be told without a host sync (BatchNorm's kernel writes its running statistics
# without bumping their version counters), so every buffer is copied: a unit's buffers once more per forward call,
# kept to its backward (none for a unit without buffers, as a transformer block).
def checkpointed(forward: Callable, module: nn.Module) -> Callable:
    """``forward`` (a listed unit's, ``module``'s) recomputed in backward (Note [Recomputed as first run]). A unit
    without buffers gets torch's checkpoint alone, which ``torch.compile`` traces whole (Note [Compiling per unit] in
    compiling.py); the copies of a unit's buffers are Python that it does not."""

    def plain(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        found = [(m, name, b.detach().clone()) for m in module.modules() for name, b in m._buffers.items()
                 if b is not None]

        def replay(*a: Any, **kw: Any) -> Any:
            if not in_backward() or not found:
                return forward(*a, **kw)
            now = [(m, name, m._buffers[name]) for m, name, _ in found]
            for m, name, value in found:
                m._buffers[name] = value.clone()  # the recomputation's own copy (a retained graph runs it again)
            try:
                return forward(*a, **kw)
            finally:
                for m, name, b in now:
                    m._buffers[name] = b

        return torch.utils.checkpoint.checkpoint(replay, *args, use_reentrant=False, **kwargs)

    return run if any(True for _ in module.buffers()) else plain
