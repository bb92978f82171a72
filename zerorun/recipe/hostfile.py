"""DeepSpeed's hostfile format: one ``host slots=N`` per line; ``#`` comments and blank lines are ignored.

::

    # two nodes, four ranks each
    worker-1 slots=4
    worker-2 slots=4
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass

from zerorun.errors import ZerorunError

#: The most ranks (slots) one host may run: more than any machine has cores or accelerators; a bound that
#: keeps a typo such as ``slots=10**20`` or ``slots=100000000000000000000`` from filling the launcher's memory.
MAX_SLOTS = 4096
_LINE = re.compile(r"(?P<host>[A-Za-z0-9_.:\-\[\]]+)(?:\s+slots\s*=\s*(?P<slots>\S+))?")  # fullmatch


#: the words a count of ranks per node may be (Note [Ranks per node] in zerorun/launch/slots.py)
WORDS = ("auto", "gpu", "cpu")
#: what a count of ranks per node may be, in error lines
EXPECTED = (f"expected ranks per node from 1 to {MAX_SLOTS}, or gpu (one per visible GPU), cpu (one per CPU) or "
            "auto (one per visible GPU, else 1)")


def parse_procs(value, name: str) -> int | str:
    """``value`` (a count as text or int) as an int from 1 to :data:`MAX_SLOTS` or one of :data:`WORDS`.

    Raises:
        ValueError: anything else; the message names ``name`` (the flag or field) and the value.
    """
    text = str(value).strip().lower()
    if text in WORDS:
        return text
    if isinstance(value, bool) or not (text.isascii() and text.isdigit() and len(text) <= 6
                                       and 1 <= int(text) <= MAX_SLOTS):
        raise ValueError(f"{name} {value!r}: {EXPECTED}".strip())
    return int(text)


@dataclass(frozen=True)
class Host:
    """One node: its address or SSH alias, and how many ranks (slots) it runs; ``slot_ids``: which of the
    hostfile's slots were selected (``--include host:0,2``; DeepSpeed's meaning: device indices; on this
    machine without a hostfile, its ``CUDA_VISIBLE_DEVICES`` entries: launch/slots.py ``through_visible``), or
    None for the first ``slots``."""

    name: str
    slots: int
    slot_ids: tuple[int | str, ...] | None = None

    @property
    def is_local(self) -> bool:
        """True for localhost, 127.0.0.1, ::1 and this machine's own hostname (run without SSH)."""
        return self.name in ("localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn())


def parse_hostfile(text: str, path: str = "hostfile") -> list[Host]:
    """Parse hostfile ``text``; ``path`` names it in errors.

    Raises:
        ZerorunError: a malformed line, a host name starting with ``-``, slots that are not a positive integer
            or above :data:`MAX_SLOTS`, a duplicate host, or no hosts;
            the message is ``path:LINE: ...``.
    """
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name = line.split()[0]
        if name.startswith("-"):  # before the line's form: '-oProxyCommand=...' is an option whatever follows
            raise ZerorunError(f"{path}:{lineno}: host name {name!r} starts with '-': ssh would take it for an "
                               "option (OpenSSH refuses such names too)")
        m = _LINE.fullmatch(line)
        if not m:
            raise ZerorunError(f"{path}:{lineno}: malformed line {raw.strip()!r}: expected 'HOST slots=N'")
        name, slots_text = m.group("host"), m.group("slots")
        if name.endswith(":"):  # 'host: slots=2' (YAML's habit): no host name ends so (IPv6 ones neither)
            raise ZerorunError(f"{path}:{lineno}: host name {name!r} ends with ':': write '{name[:-1]} slots=N'")
        if slots_text is None:
            raise ZerorunError(f"{path}:{lineno}: {name}: missing slots=N")
        try:
            slots = int(slots_text)
        except ValueError:
            slots = 0
        if slots <= 0 or not slots_text.isdigit():
            raise ZerorunError(f"{path}:{lineno}: {name}: slots must be a positive integer, got {slots_text!r}")
        if slots > MAX_SLOTS:
            raise ZerorunError(f"{path}:{lineno}: {name}: slots={slots_text} is more than {MAX_SLOTS}, the most "
                               "ranks zerorun runs on one host")
        if name in seen:
            raise ZerorunError(f"{path}:{lineno}: duplicate host {name!r} (first on line {seen[name]})")
        seen[name] = lineno
        hosts.append(Host(name, slots))
    if not hosts:
        raise ZerorunError(f"{path}: no hosts (expected lines like 'worker-1 slots=4')")
    return hosts


def read_hostfile(path: str) -> list[Host]:
    """Read and parse the hostfile at ``path`` (see :func:`parse_hostfile`)."""
    from zerorun.recipe.text import read_text  # yaml and pydantic: not at the launcher's import

    return parse_hostfile(read_text(path, "hostfile"), path)


def _parse_selection(spec: str, flag: str, hosts: list[Host]) -> dict[str, list[int] | None]:
    """DeepSpeed's ``host1@host2:0,1`` grammar: ``@`` separates hosts; ``:`` then comma-separated slot indices;
    a host without slots means all of them. Returns host name -> slot indices (None: all)."""
    by_name = {h.name: h for h in hosts}
    chosen: dict[str, list[int] | None] = {}
    for part in spec.split("@"):
        name, colon, slots_text = part.strip().partition(":")
        if not name:
            raise ZerorunError(f"{flag} {spec!r}: empty host name (expected 'host1@host2:0,1')")
        if name not in by_name:
            raise ZerorunError(f"{flag} {spec!r}: unknown host {name!r} (hosts: {', '.join(by_name)})")
        if not colon:
            chosen[name] = None
            continue
        slots: list[int] = []
        for item in slots_text.split(","):
            if not item.strip().isdigit():
                raise ZerorunError(f"{flag} {spec!r}: {name}: slot {item.strip()!r} is not a slot index")
            index = int(item)
            if index >= by_name[name].slots:
                raise ZerorunError(f"{flag} {spec!r}: {name}: unknown slot {index} (it has slots "
                                   f"0..{by_name[name].slots - 1})")
            slots.append(index)
        if name in chosen and chosen[name] is None:
            continue  # already all of its slots
        chosen[name] = sorted(set(chosen.get(name) or []) | set(slots))
    return chosen


def select_hosts(hosts: list[Host], include: str | None = None, exclude: str | None = None,
                 num_nodes: int | None = None, num_procs: int | None = None, nodes_flag: str = "",
                 procs_flag: str = "") -> list[Host]:
    """The hosts and slots a job uses, with DeepSpeed's launcher flags.

    Args:
        include: ``host1@host2:0,1``: only these hosts (and, with ``:``, only these slot indices).
        exclude: the same grammar: drop these hosts (without ``:``) or these slots.
        num_nodes: use the first ``num_nodes`` hosts left.
        num_procs: ranks per node (at most each host's slots; the first ones of its selected slots).
        nodes_flag, procs_flag: the flag and value that gave ``num_nodes`` and ``num_procs``, for messages
            (default ``--num-nodes N``, ``--num-procs N``).

    Raises:
        ZerorunError: both include and exclude, an unknown host or slot, a malformed spec, more nodes or procs
            than there are, or nothing left.
    """
    if include and exclude:
        raise ZerorunError("--include and --exclude are mutually exclusive; use one")
    selected: list[Host] = []
    if include:
        chosen = _parse_selection(include, "--include", hosts)
        for h in hosts:
            if h.name in chosen:
                ids = chosen[h.name]
                selected.append(h if ids is None else Host(h.name, len(ids), tuple(ids)))
    elif exclude:
        dropped = _parse_selection(exclude, "--exclude", hosts)
        for h in hosts:
            if h.name not in dropped:
                selected.append(h)
            elif dropped[h.name] is not None:
                ids = [i for i in range(h.slots) if i not in dropped[h.name]]
                if ids:
                    selected.append(Host(h.name, len(ids), tuple(ids)))
    else:
        selected = list(hosts)
    if not selected:
        raise ZerorunError(f"--exclude {exclude!r}: no host or slot is left")
    if num_nodes is not None:
        if num_nodes > len(selected):
            raise ZerorunError(f"{nodes_flag or f'--num-nodes {num_nodes}'}: only {len(selected)} host(s) selected")
        selected = selected[:num_nodes]
    if num_procs is not None:
        out = []
        for h in selected:
            if num_procs > h.slots:
                picked = (f" ({'--include ' + include if include else '--exclude ' + exclude} left {h.slots})"
                          if include or exclude else "")
                raise ZerorunError(f"{procs_flag or f'--num-procs {num_procs}'}: host {h.name} has only {h.slots} "
                                   f"slot(s){picked}")
            out.append(Host(h.name, num_procs, h.slot_ids[:num_procs] if h.slot_ids else None))
        selected = out
    return selected
