"""Which rank, node or host a failed job is blamed on, from what its nodes said (launch/observed.py).

Note [Blame]: when a rank dies, its peers fail too, inside a collective ("connection reset by peer"); those
errors are marked ``peer_failure`` by the worker and blamed last. A rank that died without an error event (a
crash, a signal, ``os._exit``) is found in torchrun's failure report (Note [Failure report] in
launch/torchrun.py), so the supervisor gives the failing node a few seconds to end and send it
(:func:`has_cause`). A node that ended for a reason of its own (a lost SSH connection, a killed watcher or
agent) is blamed over its peers' consequences; when every error is a peer failure, the rank that went quiet
first is (:func:`quiet_rank`), counting as quiet a rank its torchrun stopped after another rank's failure (the
failure report names that one first): a hung rank on the node of the rank that timed out waiting for it.
"""

from __future__ import annotations

import re
import signal
import time

from zerorun.launch.observed import Observed
from zerorun.launch.outcome import Outcome, describe_exit
from zerorun.launch.plan import LaunchPlan


#: a peer's error that says it waited in vain (gloo: "Timed out waiting", "Application timeout caused pair closure")
_TIMEOUT = re.compile(r"time(d)? ?out", re.IGNORECASE)


def _host(plan: LaunchPlan, rank: int) -> str | None:
    node = plan.node_of_rank(rank)
    return node.host.name if node else None


def end_reason(seen: Observed, nodes: int, node_rank: int | None) -> tuple[int | None, str | None]:
    """The node that ended for a reason of its own (``node_rank`` first, then in order) and that reason."""
    order = ([node_rank] if node_rank is not None else []) + list(range(nodes))
    for n in order:
        if n in range(nodes) and seen.end_reason(n):
            return n, seen.end_reason(n)
    return None, None


def has_cause(seen: Observed, nodes: int, node_rank: int) -> bool:
    """True once a failure is explained by more than peer failures (Note [Blame])."""
    return (any(not e.data.get("peer_failure") for e in seen.errors.values())
            or any(r not in seen.errors for r in seen.rank_exits)
            or any(seen.exited_early(r) for r in seen.own_exits)
            or end_reason(seen, nodes, node_rank)[1] is not None)


def failure(seen: Observed, plan: LaunchPlan, node_rank: int | None) -> Outcome:
    """The failed job's outcome, blamed as Note [Blame] says; ``node_rank``: the node whose failure ended the
    job (None: a rank's error event did)."""
    exits = seen.exits()
    own = [e for e in seen.errors.values() if not e.data.get("peer_failure")]
    # the report's first observed failure first, then ranks that were not merely stopped by a teardown
    silent = sorted((r for r, code in exits.items() if code != 0 and r not in seen.errors),
                    key=lambda r: (r not in seen.root_causes, exits[r] in (-signal.SIGTERM, -signal.SIGKILL), r))
    reason_node, reason = end_reason(seen, len(plan.nodes), node_rank)
    if own:
        return _error_outcome(plan, min(own, key=lambda e: e.time))
    torn_down = torn_down_by_torchrun(seen) & set(silent)
    timed_out = any(_TIMEOUT.search(e.data.get("message", "")) for e in seen.errors.values())
    if silent and set(silent) <= torn_down and timed_out and not reason:  # a rank killed (OOM) resets, not times out
        quiet = quiet_rank(seen, plan, torn_down)  # a hung rank: its peers timed out (before: "killed by SIGTERM")
        if quiet is not None:
            return quiet
    if silent and not reason:
        rank = silent[0]
        words = last_words(seen, plan, rank, exits[rank])
        words = f": {words}" if words else ""  # an abort's message
        return Outcome("failed", 1, rank, _host(plan, rank),
                       f"rank process ended ({describe_exit(exits[rank])}){words}")
    if reason:
        node = plan.nodes[reason_node]
        where = "" if node.host.name in reason else f" on {node.host.name}"
        return Outcome("failed", 1, None, node.host.name, f"node {reason_node}{where} ended ({reason})", lost=True)
    if seen.errors:
        return quiet_rank(seen, plan) or _error_outcome(plan, min(seen.errors.values(), key=lambda e: e.time))
    node = plan.nodes[node_rank] if node_rank is not None else None
    code = seen.ended.get(node_rank) if node_rank is not None else None
    what = describe_exit(code) if code is not None else "unknown cause"
    tail = seen.tails.get(node_rank)
    return Outcome("failed", 1, None, node.host.name if node else None,
                   f"node {node_rank} ended ({what})" + (f": {tail[-1]}" if tail else ""))


def torn_down_by_torchrun(seen: Observed) -> set[int]:
    """Ranks a torchrun stopped (SIGTERM, or SIGKILL after its grace) after another rank's failure: its failure
    report names another rank as the first observed failure."""
    return {r for r, code in seen.exits().items() if code in (-signal.SIGTERM, -signal.SIGKILL)
            and seen.root_causes and r not in seen.root_causes}


def last_words(seen: Observed, plan: LaunchPlan, rank: int, code: int) -> str | None:
    """What ``rank`` said as it ended: its own abort line; for a rank that exited with a code of its own, the
    last line it printed; for a rank killed by SIGABRT, an abort's line of its node that names no rank (C++
    writes to the rank's standard error directly), when no other rank of the node was killed by SIGABRT too."""
    if rank in seen.last_words:
        return seen.last_words[rank]
    if code > 0:  # an exit of its own: its last line (a SystemExit's message; a review found it only in the log)
        return seen.last_line.get(rank)
    node = plan.node_of_rank(rank)
    if code != -signal.SIGABRT or node is None or node.node_rank not in seen.node_last_words:
        return None
    aborted = [r for r, c in seen.exits().items() if c == -signal.SIGABRT and plan.node_of_rank(r) is node]
    return seen.node_last_words[node.node_rank] if aborted == [rank] else None


def _error_outcome(plan: LaunchPlan, event) -> Outcome:
    """A rank's error event as the outcome: bad input (``user_error``, exit code 2) in its own words, else the
    exception's type, message and where it was raised."""
    user = bool(event.data.get("user_error"))
    msg = event.data.get("message", "")
    if not user:
        msg = f"{event.data.get('type', 'Error')}: {msg}"
        if event.data.get("where"):
            msg += f" (at {event.data['where']})"
    return Outcome("failed", 2 if user else 1, event.rank, _host(plan, event.rank), msg)


def quiet_rank(seen: Observed, plan: LaunchPlan, torn_down: set[int] = frozenset()) -> Outcome | None:
    """Note [Blame], continued: when every error is a peer failure (a timeout, a reset connection), the rank
    to blame is one that went quiet first: one that reported no error and did not finish (hung, e.g. SIGSTOP,
    or exited without a word), or that finished while its peers still needed it, the one last heard from
    earliest. ``torn_down``: ranks whose torchrun stopped them after another rank's failure (its failure report
    names another first), quiet as well: a rank hung on the node of the rank that timed out."""
    first_error = min((seen.error_arrival.get(r, e.time) for r, e in seen.errors.items()), default=time.time())
    failed = {r for r, code in seen.exits().items() if code != 0} - set(torn_down)
    quiet = [r for r in range(plan.world_size) if r not in seen.errors and r not in failed
             and (r not in seen.finished or seen.finish_time.get(r, first_error) < first_error)]
    if not quiet:
        return None
    rank = min(quiet, key=lambda r: (not seen.exited_early(r), r in seen.finished, seen.heard.get(r, 0.0), r))
    node = plan.node_of_rank(rank)
    peer = min(seen.errors.values(), key=lambda e: e.time)
    if rank in seen.finished:
        what = f"rank {rank} finished while its peers still needed it"
    elif seen.exited_early(rank) or node is not None and seen.ended.get(node.node_rank) == 0:
        what = f"rank {rank} exited (exit code 0) in the middle of the job"
    else:
        heard = seen.heard.get(rank)
        when = f"last heard {first_error - heard:.1f} s before" if heard is not None else "no word from it before"
        what = f"rank {rank} stopped responding ({when} rank {peer.rank} failed)"
    detail = f"{peer.data.get('type', 'Error')}: {peer.data.get('message', '')}"
    return Outcome("failed", 1, rank, node.host.name if node else None,
                   f"{what}; rank {peer.rank} then failed: {detail}")
