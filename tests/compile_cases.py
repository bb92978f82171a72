"""Cases run on every rank of a :class:`distributed.RankPool`: a compiled model against the same model uncompiled,
at the same ZeRO stage (Note [Compiling per unit] in zerorun/zero/compiling.py).

Each case builds the tiny GPT twice from one seed, gives one engine the model and another the compiled model,
trains both on the same per-rank batches and returns the largest relative differences of loss and global
grad norm (per step) and of the final parameters, with dynamo's counts (graphs compiled in the first step and
after it, graph breaks), the warnings the compiled run raised and both engines' state-dict keys.
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

import parity_cases
from parity_cases import rel
from zerorun.zero import ZeroConfig, initialize
from zerorun.zero.compiling import dynamo_counts


def _gpt_module():
    """The tiny GPT's module, importable by its name: dynamo reads the globals of a function it inlines through
    the function's module name (a recipe's model module is in ``sys.modules`` too: rank/userload.py)."""
    mod = sys.modules.get("zerorun_test_gpt")
    if mod is None:
        mod = sys.modules["zerorun_test_gpt"] = parity_cases._gpt_module()
    return mod


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return _gpt_module().build_model(vocab_size=61, n_layer=2, n_head=2, d_model=18, max_seq_len=16)


def _engine(model, stage: int, units: tuple, activation_checkpointing: bool, optimizer: str = "AdamW"):
    return initialize(model, optimizer=optimizer, optimizer_kwargs={"lr": 1e-3, "weight_decay": 0.1},
                      config=ZeroConfig(stage=stage, bucket_mb=0.002, units=units,
                                        activation_checkpointing=activation_checkpointing))


def _batch(step: int) -> torch.Tensor:
    return parity_cases._batch("gpt", step, 0, dist.get_rank(), dist.get_world_size(), "never")


def compiled_parity(stage: int, backend: str = "aot_eager", steps: int = 5, units: tuple = ("Block",),
                    activation_checkpointing: bool = False, how: str = "torch.compile",
                    optimizer: str = "AdamW", shorter_from: int | None = None) -> dict:
    """Train the tiny GPT at ``stage`` uncompiled and compiled side by side (``how``: ``"torch.compile"``, the
    model given as ``torch.compile(model, backend=backend)``; ``"inside"``: each block's attention compiled in
    place by the user, inside a stage-3 unit), the batch's sequence shorter from step ``shorter_from`` on.
    Returns the largest relative differences (``loss``, ``grad_norm``, ``params``, ``eval``), dynamo's counts
    after each step, the compiled run's warnings, both state dicts' keys and the median step times."""
    torch._dynamo.reset()  # compiled code and guards go; the counters stay: counted from here
    base = dynamo_counts()
    plain_model, model = _model(), _model()
    if how == "torch.compile":
        model = torch.compile(model, backend=backend)
    else:
        for block in model.blocks:
            block.attn.compile(backend=backend)
    plain = _engine(plain_model, stage, units, activation_checkpointing, optimizer)
    compiled = _engine(model, stage, units, activation_checkpointing, optimizer)
    out = {"loss": 0.0, "grad_norm": 0.0, "params": 0.0, "counts": [], "times": {"plain": [], "compiled": []}}
    caught = []
    for step in range(steps):
        batch, losses, norms = _batch(step), [], []
        if shorter_from is not None and step >= shorter_from:  # another sequence length: dynamo compiles again
            batch = batch[:, :13]
        for key, engine in (("plain", plain), ("compiled", compiled)):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                start = time.perf_counter()
                loss = parity_cases._loss(engine(batch))
                engine.backward(loss)
                norms.append(float(engine.step()))
                out["times"][key].append(time.perf_counter() - start)
            losses.append(float(loss.detach()))
            if key == "compiled":
                caught += [str(w.message) for w in seen]
        out["loss"] = max(out["loss"], rel(losses[1], losses[0]))
        out["grad_norm"] = max(out["grad_norm"], rel(norms[1], norms[0]))
        out["counts"].append({k: v - base[k] for k, v in dynamo_counts().items()})
    for m in (plain.module, compiled.module):
        m.eval()
    with torch.no_grad():
        batch = _batch(steps)
        out["eval"] = rel(float(parity_cases._loss(compiled(batch))), float(parity_cases._loss(plain(batch))))
    ref, got = plain.full_state_dict(rank0_only=False), compiled.full_state_dict(rank0_only=False)
    out["keys"], out["plain_keys"] = list(got), list(ref)
    for name, value in ref.items():
        if name in got:
            out["params"] = max(out["params"], rel(got[name], value))
    out["warnings"] = caught
    out["median_s"] = {k: statistics.median(v[1:]) for k, v in out["times"].items()}
    return out


def in_place_refused(target: str) -> str:
    """The error stage 3 gives a model compiled in place (``target``: ``"model"``, or ``"block"`` for the first
    listed unit) before it partitions anything, and whether the model's parameters stayed the user's."""
    model = _model()
    (model if target == "model" else model.blocks[0]).compile(backend="aot_eager")
    try:
        _engine(model, 3, ("Block",), False)
    except ValueError as e:
        untouched = all(type(p) is torch.nn.Parameter and p.numel() > 1 for p in model.parameters())
        return f"{e} | untouched={untouched}"
    return "no error"
