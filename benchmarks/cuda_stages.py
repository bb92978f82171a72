"""ZeRO stages 0-3 at world size 1 on one CUDA device (NCCL): peak CUDA memory against model-state theory,
and samples/s. The device check of issue 4, prepared to run as one script on a machine with a GPU:

    python benchmarks/cuda_stages.py                       # the ~200M GPT, fp32 and bf16, stages 0-3
    python benchmarks/cuda_stages.py --quick --device cpu  # a small GPT on CPU (gloo), to check the script

Every (precision, stage) runs in a fresh process started by torchrun, so each peak is its own. Reported:
model-state bytes from the engine (``memory_bytes()``) and from theory (ZeRO §5 at N = 1: fp32 Adam 16Ψ,
bf16 2Ψ + 2Ψ + 12Ψ), peak allocated device memory (``torch.cuda.max_memory_allocated``, bytes; on CPU the
peak RSS), peak minus model states (activations and transients), median step time (s) and samples/s.
At world size 1 every stage holds the same model states; what differs is the runtime's transient memory
(stage 2-3 bucket gradients, stage 3 gathered units) and its overhead per step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from zero_stages import PREFIX, ROOT, run_workers


def worker(args) -> None:
    import resource

    import torch
    import torch.distributed as dist

    sys.path.insert(0, ROOT)
    from zerorun import zero
    from zerorun.rank.userload import build_model

    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    spec = (os.path.join(ROOT, "recipes/models/gpt.py"), "build_model",
            dict(vocab_size=args.vocab, n_layer=args.layers, n_head=args.heads, d_model=args.d_model,
                 max_seq_len=args.seq, tie_embeddings=False))
    stage = int(args.worker)
    if stage == 3 and not cuda:  # as the worker: meta-device construction on CPU only
        model = zero.deferred_init(build_model, *spec)
    else:
        model = build_model(*spec).to(device)
    engine = zero.initialize(model, optimizer="AdamW", optimizer_kwargs={"lr": 1e-4, "betas": (0.9, 0.95)},
                             param_groups=zero.default_param_groups(model, 0.1),
                             config=zero.ZeroConfig(stage=stage, grad_clip=1.0, units=("Block", "Embedding"),
                                                    precision=args.precision))
    g = torch.Generator().manual_seed(0)
    times = []
    for i in range(args.warmup + args.steps):
        batch = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=g).to(device)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.backward(engine(batch)["loss"])
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    if cuda:
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    step_s = statistics.median(times)
    out = {"stage": stage, "precision": args.precision, "psi": engine.num_params, "states": engine.memory_bytes(),
           "peak": peak, "step_s": step_s, "samples_s": args.micro_batch / step_s,
           "device": torch.cuda.get_device_name(device) if cuda else "cpu"}
    sys.stdout.write(PREFIX + json.dumps(out) + "\n")
    sys.stdout.flush()
    engine.close()
    dist.destroy_process_group()


def theory(psi: int) -> int:
    """Model-state bytes at world size 1 (ZeRO §5), the same 16Ψ in fp32 (4Ψ + 4Ψ + 8Ψ, Adam) and in bf16
    (2Ψ + 2Ψ + 12Ψ: fp32 master and Adam's two states)."""
    return 16 * psi


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", help=argparse.SUPPRESS)  # the stage, in a rank (zero_stages.run_workers)
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="a small GPT (4 layers, d_model 128, vocab 256)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    if args.quick:
        args.layers, args.d_model, args.heads, args.vocab, args.steps, args.warmup = 4, 128, 4, 256, 3, 1
    if args.worker:
        worker(args)
        return
    rows = []
    for precision in args.precisions.split(","):
        for stage in args.stages.split(","):
            extra = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                     if k in ("device", "layers", "d_model", "heads", "vocab", "seq", "micro_batch", "steps", "warmup")]
            try:  # one rank; NCCL or gloo as --device says
                rows.append(run_workers(os.path.abspath(__file__), stage, 1, [f"--precision={precision}", *extra],
                                        {})[0])
            except SystemExit as e:  # run_workers exits with the rank's output: report it, run the others
                print(f"stage {stage} {precision} failed: {e}")
                continue
            print(f"stage {stage} {precision} done", file=sys.stderr, flush=True)
    if not rows:
        sys.exit("every run failed")
    psi = rows[0]["psi"]
    print(f"\n{rows[0]['device']}, world size 1, GPT {args.layers}x{args.d_model}, vocab {args.vocab}, seq {args.seq}, "
          f"micro-batch {args.micro_batch}, Ψ = {psi:,}, AdamW\n")
    print("| precision | stage | model states (MiB) | theory 16Ψ (MiB) | peak memory (MiB) | peak - states (MiB) "
          "| step (s) | samples/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        states = sum(r["states"].values())
        print(f"| {r['precision']} | {r['stage']} | {states / 2**20:.0f} | {theory(psi) / 2**20:.0f} "
              f"| {r['peak'] / 2**20:.0f} | {(r['peak'] - states) / 2**20:.0f} | {r['step_s']:.3f} "
              f"| {r['samples_s']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
