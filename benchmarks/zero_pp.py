"""ZeRO++ at stage 3 on two nodes: bytes sent per rank, and of them across nodes, flat against hpZ, qwZ, qgZ.

Starts a loopback sshd (tests/sshd.py) on 127.0.0.2 and 127.0.0.3 and, for each variant in ``--variants``,
runs ``zerorun train`` of a recipe at ``zero.stage: 3`` with the hostfile ``127.0.0.2 slots=2`` /
``127.0.0.3 slots=2``: 4 ranks as a user's two nodes of 2 ranks (torchrun's ``GROUP_RANK`` 0 and 1, Note
[Nodes of a group] in zerorun/zero/topology.py). A variant is a list of recipe overrides (:data:`VARIANTS`):
``flat`` is plain stage 3, ``hpz`` adds ``zero.hierarchy=node`` (Note [Secondary shards] in
zerorun/zero/hierarchy.py), ``qwz`` ``zero.quantize_weights=int8``, ``qgz`` ``zero.quantize_grads=int8`` (Note
[Quantized gradients] in zerorun/zero/quantized_grads.py), ``hpz+qwz+qgz`` all three. Every step logs a step
event (``log.every=1``); from each run's metrics.jsonl, per rank, over the steps after ``--warmup``:

- ``comm_bytes``: bytes the rank sent in the step (ring accounting; median over steps);
- ``comm_bytes_inter_node``: of them, bytes to ranks on the other node (ZeRO++'s direct accounting; median);
- ``step_time_s`` (median), ``peak_rss_bytes`` (the run's last step event), the loss of every step.

Printed as a Markdown table, written as JSON (``benchmarks/results/zero_pp_<model>.json``). The ratio of each
variant's inter-node bytes to flat's stands beside ZeRO++'s accounting (Wang et al., arXiv:2306.10209, §3:
flat stage 3 sends 3M across nodes per step, forward all-gather, backward all-gather and reduce-scatter; hpZ
2M, its backward all-gather staying in the node; qwZ halves the forward all-gather against fp16; qgZ sends a
quarter of the reduce-scatter, int4 against fp16: all three 0.75M, 4x). zerorun's hpZ also reduce-scatters the
gradients in two levels (Note [Two-level reduce-scatter]), and it trains in fp32, where int8 is a quarter of
the bytes: its figures go below the paper's. Every step's loss is held to flat's (:data:`LOSS_TOLERANCE`: hpZ
1e-5 relative, fp32 rounding; with quantization 1e-2); the script exits 1 otherwise. Both "nodes" are this
machine, so the "network" is loopback and all 4 ranks share its cores: step times measure contention, bytes are
exact.

    python benchmarks/zero_pp.py --model tiny                        # recipes/tiny.yaml, ~1 min
    python benchmarks/zero_pp.py --model 55m --steps 4 --warmup 1    # the 55M GPT of zero_stages.py
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from sshd import LoopbackSshd  # noqa: E402

from zerorun.bench.args import ZERO_VARIANTS  # noqa: E402

#: variant name -> recipe overrides on top of the model's and the common ones
VARIANTS: dict[str, list[str]] = ZERO_VARIANTS  # zerorun bench --zero-variants runs the same

#: ZeRO++'s cross-node volume per step in units of the model's size M in fp16 (arXiv:2306.10209, §3): flat
#: 3M; hpZ keeps the backward all-gather in the node (2M); qwZ halves the forward all-gather (int8 against fp16);
#: qgZ sends a quarter of the gradients' M (int4 against fp16, §3.3)
PAPER_UNITS: dict[str, float] = {"flat": 3.0, "hpz": 2.0, "qwz": 2.5, "hpz+qwz": 1.5, "qgz": 2.25,
                                 "hpz+qwz+qgz": 0.75}

#: the largest relative difference of a step's loss from flat's: hpZ sums the gradients in another order
#: (Note [Two-level reduce-scatter]: fp32 rounding); qwZ's forward sees int8 weights, qgZ's step int8 gradients
LOSS_TOLERANCE: dict[str, float] = {"flat": 0.0, "hpz": 1e-5, "qwz": 1e-2, "hpz+qwz": 1e-2, "qgz": 1e-2,
                                    "hpz+qwz+qgz": 1e-2}

#: model name -> (recipe, overrides). ``55m``: the ~55M-parameter GPT of benchmarks/zero_stages.py (12 layers,
#: d_model 512, 8 heads, vocab 16384, seq 128, untied LM head; stage 3 units Block and Embedding), trained on
#: recipes/tiny.yaml's text (bytes: ids below 256 of the 16384).
MODELS: dict[str, tuple[str, list[str]]] = {
    "tiny": ("recipes/tiny.yaml", []),
    "55m": ("recipes/tiny.yaml", [
        "model.kwargs={vocab_size: 16384, n_layer: 12, n_head: 8, d_model: 512, max_seq_len: 128, "
        "tie_embeddings: false}", "data.seq_len=128", "zero.units=[Block, Embedding]"]),
}

HOSTS = ["127.0.0.2", "127.0.0.3"]


def run_variant(name: str, args, sshd: LoopbackSshd, folder: str) -> dict:
    """One ``zerorun train`` of ``args.model`` under variant ``name``; its per-rank figures."""
    recipe, model_overrides = MODELS[args.model]
    hosts = os.path.join(folder, "hostfile")
    log_dir = os.path.join(folder, "runs", name)
    overrides = [*model_overrides, "zero.stage=3", f"train.steps={args.warmup + args.steps}",
                 f"train.micro_batch_size={args.micro_batch}", "train.eval_every=0", "log.every=1",
                 f"log.dir={log_dir}", *VARIANTS[name]]
    cmd = [sys.executable, "-m", "zerorun", "train", recipe, *overrides, "-H", hosts, "--ssh-config", sshd.config,
           "--no-dashboard"]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}  # forwarded (PYTHON*)
    t0 = time.time()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.time() - t0
    if out.returncode != 0:
        raise RuntimeError(f"{name}: exit {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    run_dir = re.search(r"run dir (\S+)", out.stdout).group(1)
    path = os.path.join(run_dir if os.path.isabs(run_dir) else os.path.join(ROOT, run_dir), "metrics.jsonl")
    with open(path) as f:
        events = [json.loads(line) for line in f]
    steps = [e for e in events if e.get("event") == "step"]
    ranks = sorted({e["rank"] for e in steps})
    per_rank = {}
    for r in ranks:
        mine = sorted((e for e in steps if e["rank"] == r), key=lambda e: e["step"])
        assert [e["step"] for e in mine] == list(range(1, args.warmup + args.steps + 1)), [e["step"] for e in mine]
        after = mine[args.warmup:]
        per_rank[r] = {
            "comm_bytes": statistics.median(e["comm_bytes"] for e in after),
            "comm_bytes_inter_node": statistics.median(e["comm_bytes_inter_node"] for e in after),
            "comm_bytes_steps": [e["comm_bytes"] for e in mine],
            "comm_bytes_inter_node_steps": [e["comm_bytes_inter_node"] for e in mine],
            "step_time_s": statistics.median(e["step_time_s"] for e in after),
            "peak_rss_bytes": mine[-1]["peak_rss_bytes"],
            "model_state_bytes": mine[-1].get("model_state_bytes"),
            "losses": [e["loss"] for e in mine],
        }
    header = out.stdout.splitlines()[0] if out.stdout else ""
    return {"variant": name, "overrides": overrides, "command": cmd[1:], "run_dir": run_dir, "header": header,
            "wall_s": wall, "ranks": per_rank}


def fmt_bytes(n: float) -> str:
    return f"{int(n):,}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", choices=sorted(MODELS))
    parser.add_argument("--variants", default="flat,hpz", help=f"comma-separated, of {', '.join(VARIANTS)}; "
                        "flat first (the reference of the ratios and of the losses)")
    parser.add_argument("--steps", type=int, default=5, help="measured steps (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the medians")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1, help="runs of each variant, alternating order")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds one run may take")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/zero_pp_<model>.json")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or variants[0] != "flat":
        parser.error(f"--variants: flat first, then any of {list(VARIANTS)}; got {args.variants}")
    out_path = args.out or os.path.join(ROOT, f"benchmarks/results/zero_pp_{args.model}.json")
    folder = tempfile.mkdtemp(prefix="zerorun-zero-pp-")
    with open(os.path.join(folder, "hostfile"), "w") as f:
        f.write("".join(f"{h} slots=2\n" for h in HOSTS))
    sshd = LoopbackSshd(os.path.join(folder, "sshd"), HOSTS)
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    try:
        for r in range(args.rounds):
            for v in variants if r % 2 == 0 else reversed(variants):
                res = run_variant(v, args, sshd, folder)
                runs[v].append(res)
                steps = ", ".join(f"{x['step_time_s']:.2f}" for x in res["ranks"].values())
                print(f"round {r + 1}: {v}: {res['wall_s']:.0f} s; step time per rank {steps} s", file=sys.stderr)
    finally:
        sshd.stop()
    load = os.getloadavg()

    rows, failures = {}, []
    ref = runs["flat"][0]
    for v, results in runs.items():
        first = results[0]["ranks"]
        ranks = sorted(first)
        for res in results[1:]:  # bytes are exact: every round the same
            for r in ranks:
                for key in ("comm_bytes", "comm_bytes_inter_node"):
                    if res["ranks"][r][key] != first[r][key]:
                        failures.append(f"{v}: rank {r} {key} differs between rounds")
        loss_diff = max(abs(a - b) / abs(b) for res in results for r in ranks
                        for a, b in zip(res["ranks"][r]["losses"], ref["ranks"][r]["losses"]))
        if loss_diff > LOSS_TOLERANCE[v]:
            failures.append(f"{v}: a loss {loss_diff:.3g} relative from flat's (at most {LOSS_TOLERANCE[v]:g})")
        rows[v] = {
            "comm_bytes_per_rank": [first[r]["comm_bytes"] for r in ranks],
            "comm_bytes_inter_node_per_rank": [first[r]["comm_bytes_inter_node"] for r in ranks],
            "step_time_s": statistics.median(statistics.median(res["ranks"][r]["step_time_s"] for r in ranks)
                                             for res in results),
            "peak_rss_bytes_per_rank": [max(res["ranks"][r]["peak_rss_bytes"] for res in results) for r in ranks],
            "final_loss_per_rank": [first[r]["losses"][-1] for r in ranks],
            "loss_diff_vs_flat": loss_diff,
        }
    flat_inter = max(rows["flat"]["comm_bytes_inter_node_per_rank"])
    for v, row in rows.items():
        row["inter_node_vs_flat"] = max(row["comm_bytes_inter_node_per_rank"]) / flat_inter if flat_inter else None
        row["paper_vs_flat"] = PAPER_UNITS[v] / PAPER_UNITS["flat"] if v in PAPER_UNITS else None

    n = args.warmup + args.steps
    print(f"\n{args.model}: 2 nodes x 2 ranks (loopback SSH, one machine), stage 3, micro-batch {args.micro_batch}, "
          f"{n} steps ({args.warmup} warm-up), {args.rounds} round(s); {os.cpu_count()} CPUs, load average "
          f"{load[0]:.1f}\n")
    print("| variant | sent/rank/step (B) | of it inter-node (B) | inter-node vs flat | ZeRO++ (§3) | "
          "step time (s) | peak RSS/rank (MiB) | final loss | loss vs flat |\n|---|---|---|---|---|---|---|---|---|")
    for v, row in rows.items():
        sent, inter = row["comm_bytes_per_rank"], row["comm_bytes_inter_node_per_rank"]
        show = lambda xs: fmt_bytes(xs[0]) if len(set(xs)) == 1 else " / ".join(map(fmt_bytes, xs))  # noqa: E731
        paper = f"{PAPER_UNITS[v]:g}M ({row['paper_vs_flat']:.3f})" if v in PAPER_UNITS else "-"
        rss = row["peak_rss_bytes_per_rank"]
        print(f"| {v} | {show(sent)} | {show(inter)} | {row['inter_node_vs_flat']:.3f} | {paper} | "
              f"{row['step_time_s']:.2f} | {min(rss) / 2**20:.0f}-{max(rss) / 2**20:.0f} | "
              f"{row['final_loss_per_rank'][0]:.6f} | {row['loss_diff_vs_flat']:.2g} |")
    for f in failures:
        print("FAIL: " + f, file=sys.stderr)
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump({"command": " ".join(sys.argv), "model": args.model, "recipe": MODELS[args.model][0],
                   "hostfile": [f"{h} slots=2" for h in HOSTS], "steps": args.steps, "warmup": args.warmup,
                   "micro_batch": args.micro_batch, "cpus": os.cpu_count(), "loadavg_end": load,
                   "rows": rows, "failures": failures, "runs": runs}, f, indent=1)
    print(f"\nwritten: {os.path.relpath(out_path, ROOT)}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
