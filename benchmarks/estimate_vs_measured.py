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
    """The estimate for each stage (bytes per rank) for the benchmark's model and settings."""
    import torch

    from zerorun import estimate as est
    from zerorun.userload import build_model

    with torch.device("meta"):
        model = build_model(os.path.join(ROOT, "recipes/models/gpt.py"), "build_model",
                            dict(vocab_size=args.vocab, n_layer=args.layers, n_head=args.heads,
                                 d_model=args.d_model, max_seq_len=args.seq, tie_embeddings=not args.untied))
    layout = est.layout_of(model, bucket_mb=args.bucket_mb, units=("Block", "Embedding"), weight_decay=0.1)
    fp32, adamw = est.PRECISIONS["fp32"], est.optimizer_model("AdamW")
    act = est.activation_bytes(layout.shape, micro_batch=args.micro_batch, seq_len=args.seq, element_bytes=4)
    out = {"psi": layout.trainable, "activations": act}
    for stage in range(4):
        ms = est.model_states(layout, stage, args.nproc, fp32, adamw)
        out[stage] = {"params": ms.params, "grads": ms.grads, "optimizer": ms.optimizer, "states": ms.total,
                      "working_set": est.working_set(layout, stage, args.nproc, fp32, bucket_mb=args.bucket_mb)}
    return out


def main() -> None:
    import zero_stages

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    zero_stages.add_model_args(p)
    p.set_defaults(steps=3, warmup=1)
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--activation-run", type=int, default=1, help="1: also run stage 0 at micro-batch 1")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    run_args = argparse.Namespace(nproc=args.nproc, malloc_mmap_threshold=1 << 20, thp=1)

    def extra(micro_batch: int, a: argparse.Namespace = args) -> list[str]:
        return zero_stages.worker_args(argparse.Namespace(**{**vars(a), "micro_batch": micro_batch}))

    tiny = argparse.Namespace(**{**vars(args), "layers": 2, "d_model": 64, "heads": 4, "vocab": 256})
    tiny_est = estimates(tiny)
    tiny_rows = zero_stages.run_mode("0", run_args, extra(args.micro_batch, tiny))
    base = max(r["peak_rss"] for r in tiny_rows) - tiny_est[0]["states"] - tiny_est["activations"]["total_fused"]
    est = estimates(args)
    measured = {}
    for stage in args.stages.split(","):
        rows = zero_stages.run_mode(stage, run_args, extra(args.micro_batch))
        measured[int(stage)] = {"peak_rss": max(r["peak_rss"] for r in rows), "states": rows[0]["states"]}
        print(f"stage {stage} done", file=sys.stderr, flush=True)
    act_measured = None
    if args.activation_run and args.micro_batch > 1:
        rows = zero_stages.run_mode("0", run_args, extra(1))
        one = max(r["peak_rss"] for r in rows)
        b = args.micro_batch
        act_measured = (measured[0]["peak_rss"] - one) * b / (b - 1) if 0 in measured else None
    a = est["activations"]
    mib = 2**20
    print(f"\n{args.nproc} ranks, GPT {args.layers}x{args.d_model}, vocab {args.vocab}, seq {args.seq}, micro-batch "
          f"{args.micro_batch}, Ψ = {est['psi']:,}, fp32 AdamW. MiB per rank. Runtime baseline (tiny GPT run minus "
          f"its estimate): {base / mib:.0f} MiB. Activations (Korthikanti §4): {a['total'] / mib:.1f} "
          f"MiB, fused attention {a['total_fused'] / mib:.1f} MiB"
          + (f"; measured from micro-batch {args.micro_batch} vs 1 at stage 0: {act_measured / mib:.1f} MiB"
             if act_measured is not None else "") + "\n")
    print("| stage | measured peak RSS | model states (est = engine) | working set | activations (fused) "
          "| estimate | baseline + estimate | gap | gap / measured |")
    print("|---|---|---|---|---|---|---|---|---|")
    table = {}
    for stage, m in measured.items():
        e = est[stage]
        assert m["states"] == {k: e[k] for k in ("params", "grads", "optimizer")}, (stage, m["states"], e)
        total = e["states"] + e["working_set"] + a["total_fused"]
        gap = m["peak_rss"] - base - total
        table[stage] = {"peak_rss": m["peak_rss"], "estimate": total, "baseline": base, "gap": gap, **e}
        print(f"| {stage} | {m['peak_rss'] / mib:.0f} | {e['states'] / mib:.0f} | {e['working_set'] / mib:.0f} | "
              f"{a['total_fused'] / mib:.0f} | {total / mib:.0f} | {(base + total) / mib:.0f} | {gap / mib:+.0f} | "
              f"{gap / m['peak_rss']:+.0%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "baseline": base, "activations": a, "activations_measured": act_measured,
                       "stages": table}, f, indent=1)


if __name__ == "__main__":
    main()
