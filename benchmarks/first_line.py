"""Seconds from a command's start to its first line of output (stdout and stderr together), and to its exit:
how long a user looks at an empty terminal.

    python benchmarks/first_line.py -- zerorun train recipes/hf-llama-tiny.yaml --dry-run
    python benchmarks/first_line.py --rounds 3 -- zerorun train recipes/hf-llama-tiny.yaml --no-dashboard \\
        train.steps=2 train.eval_every=0

Prints one line per round (``first line 1.51 s, exit 54.49 s (rc 0): <the line>``) and the medians.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time


def once(argv: list[str]) -> tuple[float, float, int, str]:
    """``(seconds to the first line, seconds to the exit, exit status, the first line)`` of ``argv``."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = proc.stdout.readline()
    t_first = time.perf_counter() - t0
    proc.stdout.read()
    proc.wait()
    return t_first, time.perf_counter() - t0, proc.returncode, first.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    argv = args.command[1:] if args.command[:1] == ["--"] else args.command
    firsts, exits = [], []
    for _ in range(args.rounds):
        first, total, rc, line = once(argv)
        firsts.append(first)
        exits.append(total)
        print(f"first line {first:.2f} s, exit {total:.2f} s (rc {rc}): {line[:100]}", flush=True)
    print(f"median: first line {statistics.median(firsts):.2f} s, exit {statistics.median(exits):.2f} s")


if __name__ == "__main__":
    main()
