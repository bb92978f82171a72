"""Options that several ``zerorun`` commands share (hosts, selection, SSH, the launcher), and their checks."""

from __future__ import annotations

from typing import Optional

import typer

from zerorun.errors import INT64_MAX

# Options shared by `train` and `launch` (hosts, selection, SSH).
HOSTFILE = typer.Option(None, "-H", "--hostfile", help="DeepSpeed-style hostfile.")
MASTER_PORT = typer.Option(None, "--master-port", "--master_port", min=1, max=65535,
                           help="Rendezvous port on the first host (default: a free one found there).")
MASTER_ADDR = typer.Option(None, "--master-addr", "--master_addr",
                           help="The first host's address as every node reaches it (default: found from the "
                                "hostfile and the SSH config).")
INCLUDE = typer.Option(None, "--include", help="Only these hosts/slots: 'host1@host2:0,1'.")
EXCLUDE = typer.Option(None, "--exclude", help="All but these hosts/slots: 'host1@host2:0,1'.")
NUM_NODES = typer.Option(None, "--num-nodes", min=1, max=INT64_MAX, help="Use the first N hosts.")


def as_typed(value, *names: str) -> str:
    """``NAME VALUE`` for an option with several names (``--nproc-per-node``, ``--num-procs``, ...), ``NAME`` the
    one on this command line (``sys.argv``), else the first: what an error about the value names."""
    import sys

    for arg in sys.argv[1:]:
        for name in names:
            if arg == name or arg.startswith(name + "="):
                return f"{name} {value}"
    return f"{names[0]} {value}"


#: the names of the ranks-per-node option (NUM_PROCS, NPROC) and of zerorun launch's node count (NNODES)
PROCS_NAMES = ("--nproc-per-node", "--nproc_per_node", "--num-procs")
NNODES_NAMES = ("--nnodes", "--num-nodes")


def _procs(value: Optional[str]):
    """``--nproc-per-node``: N or gpu|cpu|auto, as torchrun takes it (Note [Ranks per node], launch/slots.py)."""
    from zerorun.recipe.hostfile import parse_procs

    try:
        return None if value is None else parse_procs(value, "")
    except ValueError as e:
        raise typer.BadParameter(str(e).strip()) from None


_PROCS_HELP = ("Ranks per node: N, gpu (one per visible GPU), cpu (one per CPU, as torchrun) or auto (one per visible "
               "GPU, else 1; torchrun's auto is one per CPU there); with -H at most each host's slots (gpu, auto: "
               "all of them).")
NUM_PROCS = typer.Option(None, *PROCS_NAMES, metavar="N|gpu|cpu|auto",
                         callback=_procs, help=_PROCS_HELP + " Default: launch.procs_per_node (auto).")
# `zerorun launch` takes torchrun's names too
NNODES = typer.Option(None, *NNODES_NAMES, min=1, max=INT64_MAX, help="Use the first N hosts (also --num-nodes).")
NPROC = typer.Option(None, *PROCS_NAMES, metavar="N|gpu|cpu|auto",
                     callback=_procs, help=_PROCS_HELP + " Default: 1, as torchrun's.")
SSH_USER = typer.Option(None, "--ssh-user", help="SSH user (default: from ~/.ssh/config, else yours).")
SSH_PORT = typer.Option(None, "--ssh-port", min=1, max=65535, help="SSH port (default: from ~/.ssh/config, 22).")
SSH_KEY = typer.Option(None, "--ssh-key", help="The only SSH private key to use (default: ~/.ssh/config's).")
SSH_CONFIG = typer.Option(None, "--ssh-config", help="SSH config file to read instead of ~/.ssh/config.")
SSH_LOCAL = typer.Option(False, "--ssh-local", help="Reach this machine's hosts (localhost) over SSH too.")
LAUNCHER = typer.Option(None, "--launcher", metavar="ssh|slurm|local",
                        help="How nodes start: ssh (the hostfile's hosts; this machine without -H), slurm (the "
                             "allocation's nodes through srun), local (this machine). Default: slurm inside a SLURM "
                             "allocation (SLURM_JOB_ID) without -H, else ssh.")
NO_DASHBOARD = typer.Option(False, "--no-dashboard", help="Plain one-line progress instead of the live dashboard.")


#: the longest ``--preflight-timeout`` (seconds: a day; a thread's join overflows past about 9.2e9).
MAX_PREFLIGHT_S = 86400.0


def _preflight_seconds(value: float) -> float:
    """``--preflight-timeout``: seconds from 1 to :data:`MAX_PREFLIGHT_S` (typer's own ``min`` check would say
    "greater than or equal to 1" of ``nan``, and let ``inf`` or ``1e10`` through to the preflight's thread
    joins, which raise OverflowError)."""
    if not 1 <= value <= MAX_PREFLIGHT_S:  # nan too
        raise typer.BadParameter(f"expected seconds from 1 to {MAX_PREFLIGHT_S:g} (a day); got {value:g}")
    return value


PREFLIGHT_S = typer.Option(15.0, "--preflight-timeout", callback=_preflight_seconds,
                           help="Seconds preflight may take, all hosts (1 to 86400).")
