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

_LINE = re.compile(r"^(?P<host>[A-Za-z0-9_.:\-\[\]]+)(?:\s+slots\s*=\s*(?P<slots>\S+))?$")


@dataclass(frozen=True)
class Host:
    """One node: its address or SSH alias, and how many ranks (slots) it runs."""

    name: str
    slots: int

    @property
    def is_local(self) -> bool:
        """True for localhost, 127.0.0.1, ::1 and this machine's own hostname (run without SSH)."""
        return self.name in ("localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn())


def parse_hostfile(text: str, path: str = "hostfile") -> list[Host]:
    """Parse hostfile ``text``; ``path`` names it in errors.

    Raises:
        ZerorunError: a malformed line, slots that are not a positive integer, a duplicate host, or no hosts;
            the message is ``path:LINE: ...``.
    """
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _LINE.match(line)
        if not m:
            raise ZerorunError(f"{path}:{lineno}: malformed line {raw.strip()!r}: expected 'HOST slots=N'")
        name, slots_text = m.group("host"), m.group("slots")
        if slots_text is None:
            raise ZerorunError(f"{path}:{lineno}: {name}: missing slots=N")
        try:
            slots = int(slots_text)
        except ValueError:
            slots = 0
        if slots <= 0 or not slots_text.isdigit():
            raise ZerorunError(f"{path}:{lineno}: {name}: slots must be a positive integer, got {slots_text!r}")
        if name in seen:
            raise ZerorunError(f"{path}:{lineno}: duplicate host {name!r} (first on line {seen[name]})")
        seen[name] = lineno
        hosts.append(Host(name, slots))
    if not hosts:
        raise ZerorunError(f"{path}: no hosts (expected lines like 'worker-1 slots=4')")
    return hosts


def read_hostfile(path: str) -> list[Host]:
    """Read and parse the hostfile at ``path`` (see :func:`parse_hostfile`)."""
    from zerorun.recipe import read_text

    return parse_hostfile(read_text(path, "hostfile"), path)
