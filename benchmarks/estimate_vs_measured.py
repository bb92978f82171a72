"""``zerorun estimate`` against a real run: peak RSS per rank of the built-in GPT at ZeRO stages 0-3.

    python benchmarks/estimate_vs_measured.py                       # 2 ranks, the ~55M-parameter GPT
    python benchmarks/estimate_vs_measured.py --layers 24 --d-model 768 --heads 12 --micro-batch 1   # ~200M

The runs are ``benchmarks/zero_stages.py``'s (fresh torchrun processes per stage, fp32 AdamW, stage 3 with
units Block and Embedding and meta-device init, glibc's mmap threshold fixed at 1 MiB as zerorun's launcher
sets it). For each stage the table puts the measured peak RSS per rank (max over ranks) next to the estimate:
model states (exact, checked against the engine's own report), the transient working set (gradient buckets in
flight; stage 3: gathered units) and activations per micro-batch (Korthikanti et al. 2022 §4; "fused": without
the attention scores, which ``F.scaled_dot_product_attention``'s flash kernel does not keep). Two extra
measurements split the gap: the runtime baseline (the same run with a tiny GPT, 2 layers of width 64 and a
vocabulary of 256, whose own estimate is subtracted: Python, torch, gloo, torchrun's worker, allocator) and, with ``--activation-run``, stage 0 at micro-batch 1, so that
``(peak(b) - peak(1)) * b / (b - 1)`` measures the activations of ``b`` samples.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

def estimates(args: argparse.Namespace) -> dict:
    """``zerorun estimate``'s rows for stages 0-3 (bytes per rank; CPU ranks on gloo) for the benchmark's
    model and settings, with the activations and Ψ."""
    import torch

    from zerorun import estimate as est
    from zerorun.rank.userload import build_model

    with torch.device("meta"):
        model = build_model(os.path.join(ROOT, "recipes/models/gpt.py"), "build_model",
                            dict(vocab_size=args.vocab, n_layer=args.layers, n_head=args.heads,
                                 d_model=args.d_model, max_seq_len=args.seq, tie_embeddings=not args.untied))
    layout = est.layout_of(model, bucket_mb=args.bucket_mb, units=("Block", "Embedding"), weight_decay=0.1)
    setup = est.Setup(nodes=1, procs_per_node=args.nproc, precision=est.PRECISIONS["fp32"],
                      optimizer=est.optimizer_model("AdamW"), device_memory=2**50, device="cpu", cpu_memory=2**50,
                      bandwidth=1e9, micro_batch=args.micro_batch, seq_len=args.seq, bucket_mb=args.bucket_mb)
    result = est.estimate(layout, setup)
    return {"psi": layout.trainable, "activations": result.activations, **{r.stage: r for r in result.rows}}


def main() -> None:
    import zero_stages

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    zero_stages.add_model_args(p)
    p.set_defaults(steps=3, warmup=1)
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--activation-run", type=int, default=1, help="1: also run stage 0 at micro-batch 1")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--measured", help="re-estimate the measurements stored in this --json file instead of running")
    args = p.parse_args()
    run_args = argparse.Namespace(nproc=args.nproc, malloc_mmap_threshold=1 << 20, thp=1)

    def extra(micro_batch: int, a: argparse.Namespace = args) -> list[str]:
        return zero_stages.worker_args(argparse.Namespace(**{**vars(a), "micro_batch": micro_batch}))

    if args.measured:
        with open(args.measured) as f:
            stored = json.load(f)
        stored_args = stored["args"]
        args = argparse.Namespace(**{**stored_args, "json": args.json, "measured": args.measured})
        tiny_peak, act_measured = stored["tiny_peak_rss"], stored["activations_measured"]
        measured = {int(k): {"peak_rss": v["peak_rss"], "states": v["states"]} for k, v in stored["stages"].items()}
    else:
        tiny = argparse.Namespace(**{**vars(args), "layers": 2, "d_model": 64, "heads": 4, "vocab": 256})
        tiny_peak = max(r["peak_rss"] for r in zero_stages.run_mode("0", run_args, extra(args.micro_batch, tiny)))
        measured = {}
        for stage in args.stages.split(","):
            rows = zero_stages.run_mode(stage, run_args, extra(args.micro_batch))
            measured[int(stage)] = {"peak_rss": max(r["peak_rss"] for r in rows), "states": rows[0]["states"]}
            print(f"stage {stage} done", file=sys.stderr, flush=True)
        act_measured = None
        if args.activation_run and args.micro_batch > 1 and 0 in measured:
            one = max(r["peak_rss"] for r in zero_stages.run_mode("0", run_args, extra(1)))
            act_measured = (measured[0]["peak_rss"] - one) * args.micro_batch / (args.micro_batch - 1)
    tiny_est = estimates(argparse.Namespace(**{**vars(args), "layers": 2, "d_model": 64, "heads": 4, "vocab": 256}))
    base = tiny_peak - tiny_est[0].device_total
    est = estimates(args)
    a = est["activations"]
    mib = 2**20
    print(f"\n{args.nproc} ranks, GPT {args.layers}x{args.d_model}, vocab {args.vocab}, seq {args.seq}, micro-batch "
          f"{args.micro_batch}, Ψ = {est['psi']:,}, fp32 AdamW. MiB per rank. Runtime baseline (tiny GPT run minus "
          f"its estimate): {base / mib:.0f} MiB. Activations (Korthikanti §4): {a['total'] / mib:.1f} "
          f"MiB, fused attention {a['total_fused'] / mib:.1f} MiB"
          + (f"; measured from micro-batch {args.micro_batch} vs 1 at stage 0: {act_measured / mib:.1f} MiB"
             if act_measured is not None else "") + "\n")
    print("| stage | measured peak RSS | model states (est = engine) | gathered units | backward transients "
          "| activations | estimate (Note [Peak]) | baseline + estimate | gap | gap / measured |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    table = {}
    for stage, m in measured.items():
        e = est[stage]
        assert m["states"] == {"params": e.params, "grads": e.grads, "optimizer": e.optimizer}, (stage, m, e)
        gap = m["peak_rss"] - base - e.device_total
        table[stage] = {"peak_rss": m["peak_rss"], "states": m["states"], "estimate": e.device_total, "gap": gap,
                        "model_states": e.model_states, "gathered": e.gathered, "backward": e.backward_transient,
                        "activations": e.activations}
        print(f"| {stage} | {m['peak_rss'] / mib:.0f} | {e.model_states / mib:.0f} | {e.gathered / mib:.0f} | "
              f"{e.backward_transient / mib:.0f} | {e.activations / mib:.0f} | {e.device_total / mib:.0f} | "
              f"{(base + e.device_total) / mib:.0f} | {gap / mib:+.0f} | {gap / m['peak_rss']:+.0%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "tiny_peak_rss": tiny_peak, "baseline": base, "activations": a,
                       "activations_measured": act_measured, "stages": table}, f, indent=1)


if __name__ == "__main__":
    main()
