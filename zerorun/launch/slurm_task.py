"""``python -m zerorun.launch.slurm_task``: one task of the SLURM launcher's job step, the node watcher of the
node it runs on (Note [Slurm launcher] in launch/slurm.py).

It reads the first line of standard input (srun's ``--input=all`` gives every task the launcher's line): JSON
``{"nodes": {NODE_NAME: {"node_rank": R, "spec": SPEC}}}``, picks its node's entry by ``SLURMD_NODENAME``,
prints ``@zerorun-slurm {"node_rank": R, "step": "JOB.STEP"}`` (the launcher maps srun's task label to the node
and learns the step to signal), runs the node (launch/node.py ``run_node``: torchrun, its ranks, the rest of
standard input as the launcher's watch) and prints ``@zerorun-slurm {"node_rank": R, "exit": CODE}`` before
exiting with the node's exit code.
"""

from __future__ import annotations

import json
import os
import sys

#: prefix of the task's own lines to the launcher (JSON after it).
TASK_PREFIX = "@zerorun-slurm "


def main() -> int:
    """Run this task's node; return its exit code (2 when this node is not one of the job's)."""
    from zerorun.launch.node import read_stdin_line, run_node

    payload = json.loads(read_stdin_line() or b"{}")
    name = os.environ.get("SLURMD_NODENAME", "")
    entry = payload.get("nodes", {}).get(name)
    if entry is None:
        print(f"zerorun: SLURM started a task on node {name or '(no SLURMD_NODENAME)'}, which is not one of the "
              f"job's nodes ({', '.join(payload.get('nodes', {}))})", flush=True)
        return 2
    rank = entry["node_rank"]
    step = f"{os.environ.get('SLURM_JOB_ID', '?')}.{os.environ.get('SLURM_STEP_ID', '?')}"
    print(TASK_PREFIX + json.dumps({"node_rank": rank, "step": step}), flush=True)
    code = run_node(entry["spec"])
    try:
        print(TASK_PREFIX + json.dumps({"node_rank": rank, "exit": code}), flush=True)
    except OSError:
        pass
    return code


if __name__ == "__main__":
    status = main()
    sys.stdout.flush()
    os._exit(status)  # the launcher watch thread may still be reading stdin
