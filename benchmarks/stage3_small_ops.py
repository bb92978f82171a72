"""Stage 3 against stage 2 on a model of many small ops: what stage 3 adds beyond its collectives.

    python benchmarks/stage3_small_ops.py                    # 2 gloo ranks, 48 blocks in one unit
    python benchmarks/stage3_small_ops.py --units Block      # 48 one-block units (collective latency)
    python benchmarks/stage3_small_ops.py --compile aot_eager   # the same, compiled (stage 3: each unit's forward)

The model (issue 38): ``--blocks`` blocks of ``Linear(64, 64) + GELU + LayerNorm`` in one ``Stack`` and a head,
micro-batch 8, fp32 AdamW. With ``--units Stack`` (the default) the whole stack is one stage-3 unit, so
stage 3 adds one all-gather per pass over stage 2 and the rest of the difference is per-operation overhead
(the cost of Python on every op, which on a GPU is step time for a launch-bound model). The modes run in the
same ranks, interleaved (``--rounds`` rounds of ``--steps`` steps each, after ``--warmup`` steps), and the
median step time of each is reported with the stage 3 / stage 2 ratio; both end on the same loss. Beside it,
rank 0's CPU time per step (``time.process_time``: what the rank computes, its collectives' threads included,
without the time it waits for the other rank, which on a loaded machine is most of the step's wall time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def build(blocks: int, width: int, seed: int):
    import torch
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.norm = nn.Linear(width, width), nn.LayerNorm(width)

        def forward(self, x):
            return self.norm(torch.nn.functional.gelu(self.fc(x)))

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(blocks))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stack, self.head = Stack(), nn.Linear(width, 1)

        def forward(self, x):
            return self.head(self.stack(x)).pow(2).mean()

    torch.manual_seed(seed)
    return Model()


def rank_main(rank: int, world_size: int, port: int, args, out) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    import zerorun.zero as zero

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    engines = {}
    for stage in (2, 3):
        model = build(args.blocks, args.width, seed=0)
        if args.compile:  # Note [Compiling per unit] in zerorun/zero/compiling.py
            model = torch.compile(model, backend=args.compile)
        config = zero.ZeroConfig(stage=stage, units=tuple(args.units.split(",")) if stage == 3 else (),
                                 persistence_threshold=args.persist)
        engines[stage] = zero.initialize(model, optimizer="AdamW", optimizer_kwargs={"lr": 1e-3}, config=config)
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randn(args.micro_batch, args.width, generator=gen) for _ in range(4)]
    times, cpu, losses = {2: [], 3: []}, {2: [], 3: []}, {2: [], 3: []}

    def steps(stage: int, n: int, keep: bool) -> None:
        engine = engines[stage]
        for i in range(n):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            loss = engine(batches[i % len(batches)])
            engine.backward(loss)
            engine.step()
            if keep:
                times[stage].append(time.perf_counter() - t0)
                cpu[stage].append(time.process_time() - c0)
                losses[stage].append(float(loss.detach()))

    for stage in (2, 3):
        steps(stage, args.warmup, keep=False)
    for r in range(args.rounds):
        for stage in ((2, 3) if r % 2 == 0 else (3, 2)):
            steps(stage, args.steps, keep=True)
    if rank == 0:
        out.put({"times": times, "cpu": cpu, "losses": losses})
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=48)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--units", default="Stack", help="zero.units at stage 3 (class names, comma-separated)")
    ap.add_argument("--compile", default="", help="torch.compile backend for both modes (aot_eager, inductor)")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--persist", type=int, default=0, help="zero.persistence_threshold (elements)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", help="write the result to this file too")
    args = ap.parse_args()

    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, args.world_size, port, args, out)) for r in range(args.world_size)]
    for p in procs:
        p.start()
    import queue

    while True:
        try:
            got = out.get(timeout=5)
            break
        except queue.Empty:
            failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if failed:
                for p in procs:
                    p.kill()
                sys.exit(f"stage3_small_ops: a rank failed (exit code {failed[0]}): see its output above")
    for p in procs:
        p.join()
    med = {s: statistics.median(got["times"][s]) for s in (2, 3)}
    cpu = {s: statistics.median(got["cpu"][s]) for s in (2, 3)}
    row = {"blocks": args.blocks, "units": args.units, "compile": args.compile or None,
           "stage2_s": med[2], "stage3_s": med[3], "ratio": med[3] / med[2],
           "stage2_cpu_s": cpu[2], "stage3_cpu_s": cpu[3], "cpu_ratio": cpu[3] / cpu[2],
           "stage2_last_loss": got["losses"][2][-1], "stage3_last_loss": got["losses"][3][-1],
           "rounds": args.rounds, "steps": args.steps}
    print(f"stage 2 {med[2] * 1e3:.1f} ms/step, stage 3 {med[3] * 1e3:.1f} ms/step: stage 3 / stage 2 = "
          f"{row['ratio']:.2f}x; CPU time of rank 0 {cpu[2] * 1e3:.1f} / {cpu[3] * 1e3:.1f} ms: "
          f"{row['cpu_ratio']:.2f}x (median of {args.rounds * args.steps} steps each, interleaved; last loss "
          f"{row['stage2_last_loss']:.6f} / {row['stage3_last_loss']:.6f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
