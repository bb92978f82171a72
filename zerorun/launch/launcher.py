"""Which launcher a job uses, as a typed value: :class:`Launcher` (ssh, slurm, local), chosen once from the
command line by :func:`choose_launcher` and passed on as is (never re-read from a string).

Note [Launchers]: each launcher is a backend that makes the job's nodes (launch/job.py ``prepare``):
- ``ssh``: the hostfile's hosts, each remote one reached over SSH (launch/remote.py) after a preflight; a host
  that is this machine (``localhost``, ``127.0.0.1``) runs as a local node unless ``--ssh-local``. Without a
  hostfile, this machine alone (today's default, which ``-h`` documents).
- ``local``: this machine alone, no SSH, no preflight, whatever the host is called; a hostfile is refused.
- ``slurm``: the allocation's nodes, one srun step (Note [Slurm launcher] in launch/slurm.py).
"""

from __future__ import annotations

import enum
import os

from zerorun.errors import ZerorunError


class Launcher(enum.Enum):
    """How the nodes of a job start (Note [Launchers]); ``str()`` is the ``--launcher`` word."""

    SSH = "ssh"
    SLURM = "slurm"
    LOCAL = "local"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, word: "str | Launcher") -> "Launcher":
        """The launcher named ``word`` (``ssh``, ``slurm``, ``local``; a :class:`Launcher` passes as is).

        Raises:
            ZerorunError: any other word, as ``--launcher WORD: expected one of ssh, slurm, local``.
        """
        if isinstance(word, cls):
            return word
        try:
            return cls(word)
        except ValueError:
            raise ZerorunError(f"--launcher {word}: expected one of {', '.join(m.value for m in cls)}") from None


def choose_launcher(launcher: "str | Launcher | None", hostfile: str | None, environ=None) -> Launcher:
    """The launcher a job uses: ``launcher`` when given (``ssh``, ``slurm`` or ``local``), else ``slurm`` inside
    a SLURM allocation (``SLURM_JOB_ID`` set) without a hostfile, else ``ssh`` (the hostfile's hosts, or this
    machine without one: today's behaviour).

    Raises:
        ZerorunError: an unknown launcher; ``slurm`` outside an allocation, with a hostfile, or inside a job step
            (``SLURM_STEP_ID`` set: ``srun zerorun train``, whose own srun step would wait for ever); ``local``
            with a hostfile.
    """
    from zerorun.launch.slurm import refuse_inside_step

    env = os.environ if environ is None else environ
    if launcher is None:
        if not env.get("SLURM_JOB_ID") or hostfile:
            return Launcher.SSH
        launcher = Launcher.SLURM
    if launcher in ("slurm", Launcher.SLURM):
        refuse_inside_step(env)
    chosen = Launcher.parse(launcher)
    if chosen is Launcher.SLURM and hostfile:
        raise ZerorunError("--launcher slurm takes its hosts from the SLURM allocation: drop -H/--hostfile")
    if chosen is Launcher.SLURM and not env.get("SLURM_JOB_ID"):
        raise ZerorunError("--launcher slurm: not inside a SLURM allocation (SLURM_JOB_ID is not set): run it "
                           "under salloc or in an sbatch script")
    if chosen is Launcher.LOCAL and hostfile:
        raise ZerorunError("--launcher local runs on this machine alone: drop -H/--hostfile")
    return chosen
