"""Cases run on every rank of a :class:`distributed.RankPool`: stage 3 with its parameter slices offloaded to
disk (``zero.offload_params: disk``, Note [Parameter offload] in zerorun/zero/param_offload.py) trains to
stage 0's numbers, keeps no slice resident between uses, and its checkpoints move to and from engines without
offload."""

from __future__ import annotations

import glob
import os

import torch
import torch.distributed as dist

from checkpoint_cases import _engine, _recipe, _train
from parity_cases import _gpt_module
from zerorun import checkpoint
from zerorun.zero import ZeroConfig, deferred_init, initialize


def _resident_bytes(store) -> int | None:
    """Bytes of ``store``'s mapping resident in this process now (``/proc/self/smaps``); ``None`` when there is
    no mapping (or it is not found)."""
    if store.map is None:
        return None
    found = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if len(head) >= 6 and "-" in head[0] and store.file.path in line:
                found = True
            elif found and head[0] == "Rss:":
                return int(head[1]) * 1024
    return None


def _params_files(swap: str) -> list[str]:
    return glob.glob(os.path.join(swap, f"zerorun-offload-params-rank{dist.get_rank()}-*.bin"))


def offload_params_run(root: str, swap: str) -> dict:
    """One group serves every check: losses of stage 0 (reference), stage 3 with parameter offload (optimizer
    none / disk), resumed across offload and none; the swap file's life; resident slice bytes after a step."""
    out: dict = {}
    steps = range(1, 5)
    engine, scheduler = _engine(0, 0)
    out["stage0"] = _train(engine, scheduler, steps)
    engine.close()

    offload = {"offload_params": "disk", "offload_path": swap}
    engine, scheduler = _engine(3, 0, zero=offload)
    store = engine.param_store
    out["file_while_running"] = len(_params_files(swap)) == 1
    out["slice_bytes"] = sum(b.shard_data.nbytes for b in engine.buffers)
    losses = _train(engine, scheduler, range(1, 3))
    out["resident_after_step"] = _resident_bytes(store)
    out["resident_touched"] = (sum(float(b.shard_data.sum()) for b in engine.buffers), _resident_bytes(store))[1]
    store.release_all()
    out["resident_released"] = _resident_bytes(store)
    out["memory_params"] = engine.memory_bytes()["params"]
    out["offload_disk"] = engine.offload_bytes()["disk"]
    path, _, _ = checkpoint.save(engine, root, 2, scheduler=scheduler, position=checkpoint.DataPosition(),
                                 recipe=_recipe(), keep=2)
    losses += _train(engine, scheduler, range(3, 5))
    out["offload"] = losses
    engine.close()
    out["file_after_close"] = len(_params_files(swap))

    engine, scheduler = _engine(3, 1)  # no offload, resumed from the offloaded engine's checkpoint
    step, _ = checkpoint.load(path, engine, scheduler=scheduler, micro_batch_size=_recipe()["train"]["micro_batch_size"])
    out["resumed_without"] = _train(engine, scheduler, range(step + 1, 5))
    engine.close()
    engine, scheduler = _engine(3, 1, zero=dict(offload, offload_optimizer="disk", offload_buffer_mb=0.01))
    step, _ = checkpoint.load(path, engine, scheduler=scheduler, micro_batch_size=_recipe()["train"]["micro_batch_size"])
    out["resumed_with_both"] = _train(engine, scheduler, range(step + 1, 5))
    engine.close()
    engine, scheduler = _engine(3, 0, zero=dict(offload, offload_optimizer="disk", offload_buffer_mb=0.01))
    out["both"] = _train(engine, scheduler, steps)
    engine.close()
    return out


def deferred_offload(swap: str) -> dict:
    """A model built on the meta device (its construction replayed into the file-backed slices) trains as the
    same model built normally at stage 0."""
    gpt = _gpt_module()
    kwargs = dict(vocab_size=61, n_layer=2, n_head=2, d_model=18, max_seq_len=16)
    results = {}
    for name, deferred, zero in (("stage0", False, {"stage": 0}),
                                 ("offload", True, {"stage": 3, "units": ("Block",), "offload_params": "disk",
                                                    "offload_path": swap})):
        torch.manual_seed(0)
        model = deferred_init(gpt.build_model, **kwargs) if deferred else gpt.build_model(**kwargs)
        engine = initialize(model, optimizer="AdamW", optimizer_kwargs={"lr": 3e-3},
                            config=ZeroConfig(bucket_mb=0.002, **zero))
        losses = []
        for step in range(3):
            batch = torch.randint(0, 61, (4, 17), generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
            loss = engine(batch)
            loss = loss["loss"] if isinstance(loss, dict) else loss
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / dist.get_world_size())
        engine.close()
        results[name] = losses
    return results
