"""How fast ``zerorun train`` starts, against plain torchrun of the same worker.

For 1 and 2 local ranks, runs ``zerorun train recipes/tiny.yaml`` (a few steps, no evaluation, a step event
every step, ``--no-dashboard``) and, as the reference, ``python -m torch.distributed.run --nproc-per-node=N
-m zerorun.rank.worker --recipe-file F`` with the same resolved recipe and the environment zerorun gives its ranks
(``OMP_NUM_THREADS`` = cores / ranks, the allocator settings). Measured from the command's start:

- ``first_line_s``: until the command's first output line (zerorun: its job header; torchrun: none of its
  own, so this is left out for it);
- ``first_step_s``: until rank 0's first step is reported (zerorun: its ``step 1/..`` line; torchrun: rank 0's
  ``@zerorun`` step event on stdout);
- ``total_s``: until the command exited.

Modes alternate order across rounds; medians (and the ratio zerorun / torchrun of ``first_step_s``) are
printed as a Markdown table and written as JSON. ``--pythonpath DIR`` runs another checkout's zerorun (e.g. an
older commit, to compare) for the zerorun mode.

    python benchmarks/startup.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

OVERRIDES = ["train.steps=3", "train.eval_every=0", "log.every=1"]


def timed(cmd: list[str], env: dict, first_step: str, cwd: str) -> dict:
    """Run ``cmd``; seconds to its first output line, to the first line starting with ``first_step``, and to
    its exit."""
    t0 = time.time()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first_line = step = None
    lines = []
    for line in proc.stdout:
        now = time.time() - t0
        lines.append(line)
        if first_line is None and line.strip():
            first_line = now
        if step is None and line.startswith(first_step):
            step = now
    code = proc.wait()
    if code != 0 or step is None:
        raise RuntimeError(f"{' '.join(cmd[:6])}...: exit {code}, no first step:\n{''.join(lines[-20:])}")
    return {"first_line_s": first_line, "first_step_s": step, "total_s": time.time() - t0}


def zerorun_cmd(ranks: int, folder: str) -> list[str]:
    return [sys.executable, "-m", "zerorun", "train", os.path.join(ROOT, "recipes/tiny.yaml"), *OVERRIDES,
            f"launch.procs_per_node={ranks}", f"log.dir={folder}/runs", "--no-dashboard"]


def torchrun_cmd(ranks: int, folder: str) -> tuple[list[str], dict]:
    from zerorun.allocator import MMAP_THRESHOLD
    from zerorun.launch.plan import free_port
    from zerorun.recipe import load_recipe

    recipe = load_recipe(os.path.join(ROOT, "recipes/tiny.yaml"), [*OVERRIDES, f"log.dir={folder}/runs"])
    path = os.path.join(folder, "recipe.json")
    with open(path, "w", encoding="utf-8") as f:
        f.write(recipe.model_dump_json())
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks)),
           "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "THP_MEM_ALLOC_ENABLE": "1"}
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--nnodes=1",
            "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "zerorun.rank.worker",
            "--recipe-file", path], env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="1,2", help="local ranks, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pythonpath", default=ROOT, help="the checkout whose zerorun the zerorun mode runs")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks/results/startup.json"))
    args = parser.parse_args()
    ranks = [int(r) for r in args.ranks.split(",")]
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="zerorun-startup-") as folder:
        base_env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        for r in range(args.rounds):
            modes = [(n, m) for n in ranks for m in ("zerorun", "torchrun")]
            for n, mode in modes if r % 2 == 0 else list(reversed(modes)):
                if mode == "zerorun":
                    env = {**base_env, "PYTHONPATH": args.pythonpath}
                    out = timed(zerorun_cmd(n, folder), env, "step ", args.pythonpath)
                else:
                    cmd, extra = torchrun_cmd(n, folder)
                    out = timed(cmd, {**base_env, **extra, "PYTHONPATH": ROOT}, '@zerorun {"v":1,"event":"step"',
                                folder)
                    out["first_line_s"] = None
                results.setdefault(f"{mode} {n}", []).append(out)
                print(f"round {r + 1} {mode} {n} rank(s): " + ", ".join(
                    f"{k} {v:.2f}" for k, v in out.items() if v is not None), flush=True)
    table = {}
    for key, runs in results.items():
        table[key] = {k: statistics.median(x[k] for x in runs) if runs[0][k] is not None else None
                      for k in runs[0]}
    lines = ["| ranks | command | first line (s) | first step (s) | exit (s) | first step vs torchrun |",
             "|---|---|---|---|---|---|"]
    for n in ranks:
        ref = table[f"torchrun {n}"]["first_step_s"]
        for mode in ("zerorun", "torchrun"):
            m = table[f"{mode} {n}"]
            fl = "-" if m["first_line_s"] is None else f"{m['first_line_s']:.2f}"
            lines.append(f"| {n} | {'zerorun train' if mode == 'zerorun' else 'python -m torch.distributed.run'} "
                         f"| {fl} | {m['first_step_s']:.2f} | {m['total_s']:.2f} | {m['first_step_s'] / ref:.2f}x |")
    print("\n".join(lines))
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"rounds": args.rounds, "pythonpath": args.pythonpath, "medians": table, "runs": results,
                   "load_avg": os.getloadavg()}, f, indent=1)


if __name__ == "__main__":
    main()
