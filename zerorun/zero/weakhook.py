"""Hooks that torch keeps in C++ and that call back into an object of the runtime, holding it weakly.

Note [Hooks hold their owner weakly]: a hook registered on a parameter (``register_post_accumulate_grad_hook``)
is kept by torch in C++, where Python's cycle collector cannot see it (so is a DDP comm hook and its state:
zerorun's DDP baseline gives it a byte counter as its state, never the engine). A hook that is a bound method
of the engine's reducer makes the cycle parameter -> hook -> reducer -> parameter, and the collector never
frees it: an engine dropped without ``close()`` kept every parameter, gradient and optimizer state alive (16Ψ
bytes per engine in fp32 with Adam; seen on an H200 as 1.1 GiB more peak memory per engine built in one
process, benchmarks/results/gpu_check_cuda_before_leak_fix.md). The hook holds its owner
through a ``weakref.WeakMethod`` instead and does nothing once the owner is gone (stages 0-2: a parameter that
outlives its engine keeps a hook that is a no-op, and a second engine over the same model is not driven by the
first's). A stage-3 engine is different by design: it holds its model's parameters partitioned, and its
forward hooks on the model's modules (plain Python, which the collector sees) keep it alive as long as the
model lives; a second engine over that model is refused in one line (``initialize``).
FSDP2 and plain DDP keep no such cycle either (tests/reducer_memory_cases.py ``released_when_dropped``).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable


def weak_hook(method: Callable[..., Any]) -> Callable[..., Any]:
    """A function calling the bound ``method`` while its object lives (Note [Hooks hold their owner weakly]);
    ``None`` once the object is gone, without calling anything."""
    ref = weakref.WeakMethod(method)

    def hook(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args, **kwargs)

    return hook
