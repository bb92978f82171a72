"""``zerorun show RUN_DIR --plot FILE``: loss and memory of every rank over steps, drawn with matplotlib.

matplotlib (a dependency since issue 18) is imported only here, only when asked.
"""

from __future__ import annotations

import math
import os

from zerorun.errors import ZerorunError
from zerorun.telemetry.events import Event
from zerorun.telemetry.state import JobState, integer, number

MIB = 1024 ** 2


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ZerorunError("--plot needs matplotlib (a dependency of zerorun), which is not importable here: "
                           "pip install matplotlib") from None
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


PLOT_FORMATS = (".png", ".svg", ".pdf", ".jpg", ".jpeg")


def check_plot_path(path: str) -> None:
    """Refuse, before anything is drawn or written, a ``--plot`` path that is a directory or whose extension
    names no image format (matplotlib would otherwise append ``.png`` and write elsewhere).

    Raises:
        ZerorunError: ``path`` is a directory, has no image extension, or its folder does not exist.
    """
    ext = os.path.splitext(path)[1].lower()
    if os.path.isdir(path) or ext not in PLOT_FORMATS:
        raise ZerorunError(f"--plot {path}: give an image file name ending in {', '.join(PLOT_FORMATS)}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ZerorunError(f"--plot {path}: no such folder: {folder}")


def latest_try(events: list[Event]) -> dict[int, list[Event]]:
    """Each rank's step events as the job's last try left them (Note [Job restarts] in launch/restart.py): a
    ``restart`` event drops every rank's steps after its ``resume_step`` (the steps the failed try ran past the
    checkpoint it resumes from, a rank the new try runs without included), and a step at or below one already
    seen replaces that step and the ones after (a ``--resume`` into the same run folder)."""
    out: dict[int, list[Event]] = {}
    for e in events:
        if e.kind == "restart" and integer(e.data, "resume_step") is not None:  # None: a script's, unknown
            resume = integer(e.data, "resume_step")
            for mine in out.values():
                while mine and mine[-1].data["step"] > resume:
                    mine.pop()
        elif e.kind == "step" and number(e.data, "step") is not None:
            mine = out.setdefault(e.rank, [])
            while mine and mine[-1].data["step"] >= e.data["step"]:
                mine.pop()
            mine.append(e)
    return {rank: mine for rank, mine in out.items() if mine}


def plot_run(state: JobState, events: list[Event], path: str) -> None:
    """Draw into ``path`` (its extension picks the format: .png, .svg, .pdf): top, training loss per rank
    and validation loss over steps; bottom, RSS (solid) and model-state bytes (dashed) per rank in MiB.

    Raises:
        ZerorunError: matplotlib is not installed, the run has no step events, or ``path`` cannot be written.
    """
    check_plot_path(path)
    steps = latest_try(events)
    if not steps:
        raise ZerorunError(f"--plot {path}: the run has no step events to plot")
    plt = _pyplot()
    fig, (ax_loss, ax_mem) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for rank, mine in sorted(steps.items()):
        x = [e.data["step"] for e in mine]
        loss = [number(e.data, "loss") if number(e.data, "loss") is not None else math.nan for e in mine]
        ax_loss.plot(x, loss, label=f"rank {rank}", linewidth=1)
        line, = ax_mem.plot(x, [(number(e.data, "rss_bytes") or 0) / MIB for e in mine], label=f"rank {rank} RSS")
        model = [sum(v for v in (e.data.get("model_state_bytes") or {}).values() if isinstance(v, (int, float))) / MIB
                 for e in mine]
        ax_mem.plot(x, model, linestyle="--", color=line.get_color(), label=f"rank {rank} model states")
    if state.evals:
        ax_loss.plot([s for s, _ in state.evals], [v for _, v in state.evals], "ko-", label="validation")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title(f"{state.name}: loss and memory per rank")
    ax_loss.legend(fontsize="small")
    ax_mem.set_ylabel("MiB")
    ax_mem.set_xlabel("step")
    ax_mem.legend(fontsize="small")
    fig.tight_layout()
    try:
        fig.savefig(path)
    except (OSError, ValueError) as err:
        raise ZerorunError(f"--plot {path}: cannot write the plot: {getattr(err, 'strerror', None) or err}") from None
    finally:
        plt.close(fig)
    if not os.path.exists(path):
        raise ZerorunError(f"--plot {path}: the plot was not written")
