"""What telemetry and the live dashboard cost: the default recipe with a step event every step and the live
dashboard on a (pseudo-)terminal, against logging off (step events at the first and last step only, which the
measurement itself needs) with plain output into a pipe.

    python benchmarks/telemetry_overhead.py                  # recipes/gpt-stdlib.yaml, 120 steps, 5 rounds
    python benchmarks/telemetry_overhead.py --steps 60 --rounds 2

Everything else is the same in both modes (``train.eval_every=0`` in both). The modes alternate, round by
round, because these machines are shared and noisy. Reported per mode: the mean step time of each run, from
each rank's ``finish`` event, ``(elapsed_s - time_to_first_step_s) / (steps - 1)``: the wall-clock time of
steps 2 to the last, every logging cost in between included; the median over rounds; the overhead (median on /
median off - 1) and the median of the paired per-round overheads. Also: the worker's own time per step event
(``telemetry_s``: the loss all-reduce, memory probes and the write) and the launcher's CPU time per second of
the job (the parsing, recording and drawing, competing with the ranks for the same cores). Results also go to
``benchmarks/results/telemetry_overhead.json``.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import pty
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_once(recipe: str, steps: int, on: bool, workdir: str) -> dict:
    """One ``zerorun train`` run; returns its step time (s), worker telemetry time per event (s) and the
    launcher's CPU seconds per wall second."""
    log_dir = tempfile.mkdtemp(dir=workdir)
    cmd = [sys.executable, "-m", "zerorun", "train", recipe, f"train.steps={steps}", "train.eval_every=0",
           f"log.every={1 if on else steps}", f"log.dir={log_dir}"]
    env = {**os.environ, "PYTHONPATH": ROOT}
    if on:  # the live dashboard needs a terminal: give it a 120x40 pseudo-terminal and keep reading it
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**env, "TERM": "xterm-256color"}, stdin=subprocess.DEVNULL,
                                stdout=slave, stderr=slave)
        os.close(slave)
        threading.Thread(target=_drain_fd, args=(master,), daemon=True).start()
    else:
        proc = subprocess.Popen(cmd + ["--no-dashboard"], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        threading.Thread(target=proc.stdout.read, daemon=True).start()
    launcher, cpu, t0 = psutil.Process(proc.pid), 0.0, time.time()
    while proc.poll() is None:
        try:
            times = launcher.cpu_times()
            cpu = times.user + times.system
        except psutil.Error:
            pass
        time.sleep(0.2)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"run failed (exit {proc.returncode}): {' '.join(cmd)}")
    [metrics] = [os.path.join(d, f) for d, _, files in os.walk(log_dir) for f in files if f == "metrics.jsonl"]
    events = [json.loads(line) for line in open(metrics, encoding="utf-8")]
    step_times = [(e["elapsed_s"] - e["time_to_first_step_s"]) / (steps - 1) for e in events
                  if e["event"] == "finish"]
    tele = [e["telemetry_s"] for e in events if e["event"] == "step" and 1 < e["step"] < steps]
    return {"step_s": statistics.mean(step_times), "telemetry_s": statistics.median(tele) if tele else 0.0,
            "launcher_cpu_per_s": cpu / wall}


def _drain_fd(fd: int) -> None:
    try:
        while os.read(fd, 65536):
            pass
    except OSError:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default=os.path.join(ROOT, "recipes/gpt-stdlib.yaml"))
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks/results/telemetry_overhead.json"))
    args = parser.parse_args()
    results: dict[str, list[dict]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory() as workdir:
        for i in range(args.rounds):
            for mode in (("on", "off") if i % 2 == 0 else ("off", "on")):
                r = run_once(args.recipe, args.steps, mode == "on", workdir)
                results[mode].append(r)
                print(f"round {i + 1} {mode:>3}: {r['step_s'] * 1e3:.1f} ms/step, launcher "
                      f"{100 * r['launcher_cpu_per_s']:.1f}% of a core, "
                      f"telemetry {r['telemetry_s'] * 1e3:.2f} ms/event",
                      flush=True)
    on = statistics.median(r["step_s"] for r in results["on"])
    off = statistics.median(r["step_s"] for r in results["off"])
    paired = statistics.median(a["step_s"] / b["step_s"] - 1 for a, b in zip(results["on"], results["off"]))
    tele = statistics.median(r["telemetry_s"] for r in results["on"])
    summary = {"recipe": os.path.relpath(args.recipe, ROOT), "steps": args.steps, "rounds": args.rounds,
               "step_s_on": on, "step_s_off": off, "overhead": on / off - 1, "paired_overhead_median": paired,
               "telemetry_s_per_event": tele, "telemetry_fraction_of_step": tele / on,
               "launcher_cpu_per_s_on": statistics.median(r["launcher_cpu_per_s"] for r in results["on"]),
               "launcher_cpu_per_s_off": statistics.median(r["launcher_cpu_per_s"] for r in results["off"]),
               "runs": results}
    print(f"logging every step + live dashboard: {on * 1e3:.1f} ms/step; logging off: {off * 1e3:.1f} ms/step; "
          f"overhead {100 * (on / off - 1):+.2f}% (paired median {100 * paired:+.2f}%)")
    print(f"worker time per step event {tele * 1e3:.2f} ms ({100 * tele / on:.2f}% of a step); launcher CPU "
          f"{100 * summary['launcher_cpu_per_s_on']:.1f}% of a core with the dashboard, "
          f"{100 * summary['launcher_cpu_per_s_off']:.1f}% without")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
