"""What the ranks are doing before they train, from their ``phase`` events (telemetry/events.py).

Note [Rank phases]: a job's first step comes 12-27 s after the launch on a busy machine (Python and torch
imports, the rendezvous, building the model and the data, the first step's allocations), and "waiting for
ranks" said nothing of where that time goes or which rank holds the job up. Each rank emits a ``phase`` event
as it starts each of :data:`PHASES` (zerorun/rank/loop.py, zerorun/rank/script_worker.py); the launcher's views show
the slowest rank's phase (the earliest in :data:`PHASES` among the ranks not training yet; a rank that sent
nothing yet is ``starting``), how many ranks are in it, and since when. A phase the launcher does not know (a
newer worker) counts as later than every known one. No rank waits for these events: they are one line each
on the rank's stdout.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerorun.telemetry.format import human_duration, rank_list

#: a rank's phases before its first step event, in order.
SCRIPT = "running the script"  # zerorun launch's ranks: no longer waited for
PHASES = ("starting", "importing torch", "joining the process group", "building the model", "loading data",
          "setting up ZeRO", "loading data after the model", "loading the checkpoint", "first step", SCRIPT)


@dataclass(frozen=True)
class Waiting:
    """The slowest ranks' ``phase``, their ``ranks`` (of ``world``), and ``since`` (Unix s) the first of them
    entered it (``None``: no event yet, since the launch)."""

    phase: str
    ranks: tuple[int, ...]
    world: int
    since: float | None

    def who(self) -> str:
        """``rank 1 of 4``, ``ranks 0-2 of 4``, ``all 4 ranks``."""
        if len(self.ranks) == self.world:
            return "the one rank" if self.world == 1 else f"all {self.world} ranks"
        return (f"rank {self.ranks[0]}" if len(self.ranks) == 1 else f"ranks {rank_list(self.ranks)}") \
            + f" of {self.world}"

    def describe(self, now: float, started: float) -> str:
        """``waiting for ranks: importing torch (rank 1 of 2) for 4.2 s`` (since the phase began, or since
        ``started``, the launch, Unix s, for ranks that sent nothing yet): the dashboard's line."""
        since = self.since if self.since is not None else started
        return f"waiting for ranks: {self.phase} ({self.who()}) for {human_duration(max(0.0, now - since))}"

    def line(self, when: float, started: float) -> str:
        """``waiting for ranks: building the model (all 2 ranks), 9.1 s after the launch``: the plain view's
        line when the slowest phase changes at ``when`` (Unix s; ``started``: the launch)."""
        return f"waiting for ranks: {self.phase} ({self.who()}), {human_duration(max(0.0, when - started))} " \
            "after the launch"


def order(phase: str | None) -> int:
    """``phase``'s place in :data:`PHASES` (unknown: after them all; none: ``starting``)."""
    if phase is None:
        return 0
    return PHASES.index(phase) if phase in PHASES else len(PHASES)


def slowest(ranks) -> Waiting | None:
    """The :class:`Waiting` of ``ranks`` (:class:`~zerorun.telemetry.state.RankState` values); ``None`` once
    every rank trains, finished, failed or runs its user's script (whose steps zerorun cannot see until it
    reports them: Note [Rank phases])."""
    ranks = list(ranks)
    before = [r for r in ranks if r.status in ("starting", "started", "ready") and r.phase != SCRIPT]
    if not before or any(r.first_step_time for r in ranks):
        return None  # a rank trains: the others are in the step's collectives with it
    first = min(order(r.phase) for r in before)
    behind = [r for r in before if order(r.phase) == first]
    times = [r.phase_time for r in behind if r.phase_time is not None]
    phase = next((r.phase for r in behind if r.phase), None) or "starting"
    return Waiting(phase, tuple(sorted(r.rank for r in behind)), len(ranks),
                   min(times) if times and phase != "starting" else None)
