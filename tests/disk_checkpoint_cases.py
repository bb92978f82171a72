"""Cases run on every rank of a :class:`distributed.RankPool`: checkpoints of a disk-offloaded engine are
streamed through its paging buffer (Note [Paged checkpoints] in zero/state_paging.py) and stay compatible
with checkpoints of engines without offload."""

from __future__ import annotations

import json
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile, record_function

from checkpoint_cases import _engine, _recipe, _train, snapshot
from zerorun import checkpoint
from zerorun.errors import ZerorunError
from zerorun.zero import ZeroConfig, initialize


class Stack(nn.Module):
    """``depth`` square bias-free linear layers with tanh: Ψ = depth * width**2."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.square().mean()


def _stack_engine(seed: int, swap: str, buffer_mb: float, width: int, depth: int):
    torch.manual_seed(seed)
    engine = initialize(Stack(width, depth), optimizer="AdamW", optimizer_kwargs={"lr": 1e-3},
                        config=ZeroConfig(stage=2, offload_optimizer="disk", offload_path=swap,
                                          offload_buffer_mb=buffer_mb))
    scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 1.0)
    return engine, scheduler


def _peaks(prof) -> dict[str, int]:
    """Per ``phase:`` range of ``prof``: the largest CPU tensor bytes allocated above the total at its start."""
    path = tempfile.mktemp(prefix=f"zr-trace{dist.get_rank()}-", suffix=".json")
    prof.export_chrome_trace(path)
    with open(path, encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    os.remove(path)
    mem = sorted((e["ts"], e["args"]["Total Allocated"]) for e in events
                 if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0)
    out = {}
    for e in events:
        if str(e.get("name", "")).startswith("phase:"):
            t0, t1 = e["ts"], e["ts"] + e["dur"]
            before = [b for t, b in mem if t < t0]
            start = before[-1] if before else 0
            out[e["name"][6:]] = max([b - start for t, b in mem if t0 <= t <= t1] + [0])
    return out


def peak_extra_bytes(root: str, swap: str, buffer_mb: float = 0.25, width: int = 256, depth: int = 4) -> dict:
    """Stage 2, AdamW, disk offload: the largest CPU tensor bytes allocated above the level at its start during
    ``checkpoint.save`` and during ``checkpoint.load`` (into an engine built from another seed; up to the
    all-gather of the parameters that ends it, as it ends every step); this rank's
    bytes of masters and optimizer states; the paging buffer's bytes; whether the load restored the saved
    masters and states bit for bit."""
    rank = dist.get_rank()
    engine, scheduler = _stack_engine(0, swap, buffer_mb, width, depth)
    x = torch.randn(8, width, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        engine.backward(engine(x))
        engine.step()
    saved = snapshot(engine)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("phase:save"):
            path, _, _ = checkpoint.save(engine, root, 2, scheduler=scheduler, position=checkpoint.DataPosition(),
                                         recipe={"train": {"micro_batch_size": 8}}, keep=1)
    save = _peaks(prof)["save"]
    held = engine.offload_bytes()["host"]
    engine.close()
    engine, scheduler = _stack_engine(1, swap, buffer_mb, width, depth)
    # the all-gather of the parameters that ends a load is the one that ends every step (on gloo it holds a
    # temporary copy of the parameters): the engine's, not the checkpoint's; it runs after the measurement
    after_step, engine._after_step = engine._after_step, lambda: None
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("phase:load"):
            checkpoint.load(path, engine, scheduler=scheduler, micro_batch_size=8)
    load = _peaks(prof)["load"]
    del engine._after_step
    after_step()
    loaded = snapshot(engine)
    engine.close()
    states = sum(v.nbytes for s in saved["optim"] for v in s.values())
    same = (all(torch.equal(a, b) for a, b in zip(saved["masters"], loaded["masters"]))
            and all(torch.equal(a[k], b[k]) for a, b in zip(saved["optim"], loaded["optim"]) for k in a))
    return {"save": save, "load": load, "buffer": held, "slices": sum(m.nbytes for m in saved["masters"]) + states,
            "restored": same}


def _full(engine) -> dict:
    return engine.full_state_dict(rank0_only=False)


def across_offload(root: str, swap: str) -> dict:
    """Checkpoints move between disk offload and none; disk offload at stage 0 (every rank holds whole
    parameters) and stage 3: each load restores the saved masters and optimizer states bit for bit. Returns, per
    ``"<saved> -> <loaded>"``, whether it did."""
    tiny = {"offload_optimizer": "disk", "offload_path": swap, "offload_buffer_mb": 0.0015}
    runs = [("disk stage 2 -> none stage 2", (2, tiny), (2, {})),
            ("none stage 2 -> disk stage 2", (2, {}), (2, tiny)),
            ("disk stage 0 -> disk stage 0", (0, tiny), (0, tiny)),
            ("disk stage 0 -> none stage 1", (0, tiny), (1, {})),
            ("disk stage 3 -> disk stage 3", (3, tiny), (3, tiny))]
    out = {}
    for i, (name, (s_stage, s_zero), (l_stage, l_zero)) in enumerate(runs):
        engine, scheduler = _engine(s_stage, 0, zero=s_zero)
        _train(engine, scheduler, range(1, 3))
        path, _, _ = checkpoint.save(engine, os.path.join(root, str(i)), 2, scheduler=scheduler,
                                     position=checkpoint.DataPosition(), recipe=_recipe(), keep=1)
        saved, saved_full = snapshot(engine), {k: v.clone() for k, v in _full(engine).items()}
        engine.close()
        engine, scheduler = _engine(l_stage, 1, zero=l_zero)
        checkpoint.load(path, engine, scheduler=scheduler, micro_batch_size=_recipe()["train"]["micro_batch_size"])
        loaded, loaded_full = snapshot(engine), _full(engine)
        engine.close()
        same_model = all(torch.equal(v, loaded_full[k]) for k, v in saved_full.items())
        if s_stage != l_stage:  # another layout of the slices: the parameters are whole at stages 0-2
            out[name] = same_model
            continue
        out[name] = same_model and (
            all(torch.equal(a, b) for a, b in zip(saved["masters"], loaded["masters"]))
            and all(torch.equal(a[k], b[k]) for a, b in zip(saved["optim"], loaded["optim"]) for k in a))
    return out


def another_optimizer_state(root: str, swap: str) -> str | None:
    """Save a disk-offloaded AdamW(amsgrad) after one step, load it into AdamW without amsgrad (disk too):
    the error message, or ``None`` when the load passed."""
    path = None
    for amsgrad in (True, False):
        torch.manual_seed(0)
        engine = initialize(Stack(32, 2), optimizer="AdamW", optimizer_kwargs={"lr": 1e-3, "amsgrad": amsgrad},
                            config=ZeroConfig(stage=2, offload_optimizer="disk", offload_path=swap,
                                              offload_buffer_mb=0.01))
        scheduler = torch.optim.lr_scheduler.LambdaLR(engine.optimizer, lambda s: 1.0)
        try:
            if path is None:
                engine.backward(engine(torch.randn(4, 32)))
                engine.step()
                path, _, _ = checkpoint.save(engine, root, 1, scheduler=scheduler, position=checkpoint.DataPosition(),
                                             recipe={"train": {"micro_batch_size": 4}}, keep=1)
            else:
                checkpoint.load(path, engine, scheduler=scheduler, micro_batch_size=4)
        except ZerorunError as e:
            return str(e)
        finally:
            engine.close()
    return None
