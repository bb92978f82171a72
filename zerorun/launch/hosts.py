"""The hosts of a job (:func:`select`: a hostfile's, this machine's, or a SLURM allocation's, with the ranks
on each) and how to reach them (:func:`ssh_options`)."""

from __future__ import annotations

import os
import sys

from zerorun.errors import ZerorunError
from zerorun.recipe.hostfile import Host
from zerorun.launch.launcher import Launcher


def select(hostfile: str | None, default_slots: int | str, include: str | None = None, exclude: str | None = None,
           num_nodes: int | None = None, num_procs: int | str | None = None, launcher: Launcher = Launcher.SSH,
           job_env: dict[str, str] | None = None, nodes_flag: str = "", procs_flag: str = "") -> list[Host]:
    """The hosts of a job: the hostfile's (or localhost with ``num_procs``, else ``default_slots``, ranks)
    through ``include``/``exclude``, ``num_nodes`` and ``num_procs`` (hostfile.select_hosts, DeepSpeed's rules).
    ``default_slots`` (``launch.procs_per_node``) and ``num_procs`` (``--nproc-per-node``) are numbers or
    ``auto``/``gpu``/``cpu``, made numbers here (Note [Ranks per node] in launch/slots.py; a note on stderr
    says what a word became where it is not one rank; GPUs counted under the environment the ranks get: this
    one, the environment files' and ``job_env``, the recipe's ``launch.env``). ``launcher``: ``ssh`` (that),
    ``local`` (this machine, no hostfile), ``slurm`` (the allocation's nodes and slots, launch/slurm.py
    ``allocation_hosts``; a note on stderr says where the slot count comes from). ``nodes_flag``, ``procs_flag``:
    the flag and value that gave ``num_nodes`` (``--nnodes 1:2``) and ``num_procs`` (``--num-procs 2``), as
    typed, for messages.

    Raises:
        ZerorunError: an unreadable or bad hostfile, a bad allocation, ``gpu`` without a GPU, ``cpu`` with a
            hostfile, a selection that leaves no host, or (this machine) a number of ranks ``num_procs`` that
            ``include`` or ``exclude`` leave fewer slots for (here or in a SLURM allocation; DeepSpeed refuses
            the two together).
    """
    from zerorun.recipe.hostfile import read_hostfile, select_hosts
    from zerorun.launch.env import env_file_values
    from zerorun.launch.slots import auto_note, hostfile_procs, resolve, through_visible

    if launcher is Launcher.SLURM:
        from zerorun.launch.slurm import allocation_hosts, describe_slots

        hosts, source = allocation_hosts(default_slots, num_nodes, num_procs, nodes_flag=nodes_flag)
        hosts = select_hosts(hosts, include, exclude, None, None)
        _check_not_cut(hosts, num_procs, include, exclude, procs_flag)
        sys.stderr.write(f"zerorun: SLURM job {os.environ.get('SLURM_JOB_ID')}: {len(hosts)} node"
                         f"{'s' if len(hosts) > 1 else ''} ({', '.join(h.name for h in hosts)}), "
                         f"{describe_slots(hosts, source)}\n")
        return hosts
    if hostfile and launcher is not Launcher.LOCAL:
        return select_hosts(read_hostfile(hostfile), include, exclude, num_nodes,
                            hostfile_procs(num_procs, (procs_flag or "--nproc-per-node").split()[0]), nodes_flag,
                            procs_flag)
    value, name = (num_procs, "--nproc-per-node") if num_procs is not None else (default_slots,
                                                                                 "launch.procs_per_node")
    environ = {**os.environ, **env_file_values(), **(job_env or {})}
    slots = resolve(value, name, environ)
    note = auto_note(value, name, slots)
    if note:
        sys.stderr.write(note + "\n")
    hosts = select_hosts([Host("localhost", slots)], include, exclude, num_nodes, None, nodes_flag)
    _check_not_cut(hosts, num_procs, include, exclude, procs_flag)
    return [through_visible(h, environ) for h in hosts]


def _check_not_cut(hosts: list[Host], num_procs, include: str | None, exclude: str | None, procs_flag: str) -> None:
    """Raises ZerorunError: a number of ranks per node (``num_procs``, given as ``procs_flag``) that ``include`` or
    ``exclude`` left fewer slots for on some host (the words ``auto``/``gpu``/``cpu`` mean every slot: the
    selection picks among them)."""
    short = [h for h in hosts if isinstance(num_procs, int) and h.slots < num_procs]
    if short:
        given = "--include " + include if include else "--exclude " + str(exclude)
        raise ZerorunError(f"{procs_flag or f'--nproc-per-node {num_procs}'} and {given}: {short[0].slots} of "
                           f"{short[0].name}'s {num_procs} slots selected; give the ranks by one of them")


def ssh_options(user: str | None = None, port: int | None = None, key: str | None = None,
                config: str | None = None):
    """SSH options (launch/remote.py ``SshOptions``) from the CLI's flags.

    Raises:
        ZerorunError: ``key`` or ``config`` names no file.
    """
    from zerorun.launch.remote import SshOptions

    for flag, path in (("--ssh-key", key), ("--ssh-config", config)):
        if path is not None and not os.path.isfile(path):
            raise ZerorunError(f"{flag} {path}: " + ("not a regular file" if os.path.exists(path) else "no such file"))
    return SshOptions(user=user, port=port, key=key, config=config)
