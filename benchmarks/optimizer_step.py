"""The optimizer step alone: zerorun's stage 0 step against torch's own foreach AdamW + ``clip_grad_norm_``.

    python benchmarks/optimizer_step.py                        # both models, fp32 and bf16
    python benchmarks/optimizer_step.py --models one400 --precisions bf16 --rounds 5

One process, world size 1 on gloo, stage 0 (no collective in the step): what is timed is the step's own work,
global norm, clipping, AdamW, the write back into the parameters. Models: ``one400``, 400 parameters of 4096
elements (``Linear(64, 64, bias=False)``), and ``linear100``, the issue's 100 ``Linear(64, 64)`` (200
parameters); ``bucket_mb`` 0.001: each weight in a flat buffer of its own (biases: a few per buffer). The reference is
torch's ``AdamW(foreach=True)`` with ``clip_grad_norm_(foreach=True)`` over a copy of the same parameters (bf16:
the bf16 parameters, as a plain torch loop would hold them), and ``zero_grad()``. Rounds alternate zerorun and
torch in the same process; each round times ``--steps`` steps of each (after ``--warmup``), gradients made
untimed by a backward before each step. Timed: the thread's CPU time (``time.thread_time``; one thread,
``torch.set_num_threads(1)``, so it is all the step's work and steadier than wall-clock time on a shared
machine), and wall-clock time. Reported: the median over rounds of each round's median step time (ms) and of
their ratio.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model(name: str):
    import torch.nn as nn

    if name == "one400":
        return nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(400)])
    return nn.Sequential(*[nn.Linear(64, 64) for _ in range(100)])


def _loss(model, x):
    return sum(layer(x).square().mean() for layer in model)  # every parameter gets a gradient, shallow graph


def _time_engine(engine, x, steps: int) -> list[tuple[float, float]]:
    out = []
    for _ in range(steps):
        engine.backward(_loss(engine.module, x))
        t0, c0 = time.perf_counter(), time.thread_time()
        engine.step()
        out.append((time.thread_time() - c0, time.perf_counter() - t0))
    return out


def _time_torch(model, opt, x, steps: int) -> list[float]:
    import torch

    params = [p for p in model.parameters()]
    out = []
    for _ in range(steps):
        _loss(model, x).backward()
        t0, c0 = time.perf_counter(), time.thread_time()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad()
        out.append((time.thread_time() - c0, time.perf_counter() - t0))
    return out


def measure(model_name: str, precision: str, rounds: int, steps: int, warmup: int) -> dict:
    import torch

    from zerorun import zero

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    torch.manual_seed(0)
    model = _model(model_name)
    ref = copy.deepcopy(model).to(dtype)
    engine = zero.initialize(model, optimizer="AdamW", optimizer_kwargs={"lr": 1e-4, "weight_decay": 0.0},
                             config=zero.ZeroConfig(stage=0, grad_clip=1.0, precision=precision, bucket_mb=0.001))
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, weight_decay=0.0, foreach=True)
    x = torch.randn(8, 64, dtype=dtype)
    _time_engine(engine, x, warmup)
    _time_torch(ref, opt, x, warmup)
    rows = {"cpu": ([], [], []), "wall": ([], [], [])}
    for _ in range(rounds):
        a, b = _time_engine(engine, x, steps), _time_torch(ref, opt, x, steps)
        for k, (kind, (ours, theirs, ratios)) in enumerate(rows.items()):
            ours.append(statistics.median(t[k] for t in a))
            theirs.append(statistics.median(t[k] for t in b))
            ratios.append(ours[-1] / theirs[-1])
    out = {"model": model_name, "precision": precision, "buffers": len(engine.buffers)}
    for kind, (ours, theirs, ratios) in rows.items():
        out[kind] = {"zerorun_ms": 1e3 * statistics.median(ours), "torch_ms": 1e3 * statistics.median(theirs),
                     "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="one400,linear100")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", help="write the rows to this file too")
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    rows = []
    for model_name in args.models.split(","):
        for precision in args.precisions.split(","):
            row = measure(model_name, precision, args.rounds, args.steps, args.warmup)
            rows.append(row)
            for kind in ("cpu", "wall"):
                r = row[kind]
                print(f"{row['model']:10s} {row['precision']:5s} buffers {row['buffers']:4d} {kind:4s}  zerorun "
                      f"{r['zerorun_ms']:7.2f} ms  torch foreach AdamW+clip {r['torch_ms']:7.2f} ms  ratio "
                      f"{r['ratio']:.2f} ({r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f})", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
