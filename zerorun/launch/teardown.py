"""Stopping a job's nodes and verifying that nothing of it is left.

Note [Teardown]: torchrun starts its workers in sessions of their own, a SIGKILLed torchrun orphans them, and
a surviving agent can wait in its exit barrier ignoring SIGTERM. So teardown does not rely on one signal path:
SIGTERM to each node's process group, a grace period while the lines keep draining, then SIGKILL to the group
and to every process marked with the job id (``JOB_ENV``), repeated until none is left. Nodes are signalled
in parallel (a remote node's signal is an SSH round trip, launch/remote.py), so teardown time does not grow
with the number of hosts.
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from zerorun.launch.nodes import Node


def signal_running(nodes: list[Node], ended: dict[int, int], sig: int) -> None:
    """Send ``sig`` to every node of ``nodes`` not in ``ended`` (node rank -> status), in parallel."""
    running = [n for n in nodes if n.spec.node_rank not in ended]
    if running:
        with ThreadPoolExecutor(len(running)) as pool:
            list(pool.map(lambda n: n.send_signal(sig), running))


def teardown(nodes: list[Node], ended: dict[int, int], drain: Callable[[float], None], grace_s: float) -> dict:
    """Note [Teardown] on ``nodes``; ``ended`` (node rank -> status) fills as ``drain(timeout)`` takes the
    nodes' messages. Returns host name -> why teardown could not check that host (its node's ``unverified``)."""
    if not nodes:
        return {}
    running = [n for n in nodes if n.spec.node_rank not in ended]
    with ThreadPoolExecutor(len(nodes)) as pool:
        list(pool.map(lambda n: n.send_signal(signal.SIGTERM), running))
        deadline = time.time() + grace_s
        while time.time() < deadline and len(ended) < len(nodes):
            drain(0.1)

        def kill(node) -> int:
            node.send_signal(signal.SIGKILL)
            return node.kill_survivors(signal.SIGKILL)

        for _ in range(20):
            if not sum(pool.map(kill, nodes)):
                break
            time.sleep(0.1)
    unverified = {n.spec.host.name: n.unverified for n in nodes if n.unverified}
    deadline = time.time() + 10.0
    while len(ended) < len(nodes) and time.time() < deadline:
        drain(0.2)
    return unverified
