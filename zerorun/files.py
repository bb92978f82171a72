"""Files zerorun writes for the user: the permissions a plain ``open(path, "w")`` would give them.

Some writers create files 0600 whatever the umask (safetensors' ``save_file`` writes through a private
temporary file), so a consolidated model or an exported folder could not be read by the user's group or by
a serving process although every other file the user makes can. :func:`apply_umask` gives a finished file the
mode ``0666 & ~umask`` before it is renamed into place (the rename stays the only step that makes it visible,
so it is never seen half-written).
"""

from __future__ import annotations

import os


def current_umask() -> int:
    """This process's file mode creation mask (e.g. ``0o022``), read from ``/proc/self/status`` (Linux 4.7+)
    where possible: setting and restoring it with ``os.umask`` would change it for other threads meanwhile."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: str) -> None:
    """Give the regular file ``path`` the mode a newly created file gets: ``0o666 & ~umask`` (0644 under the
    usual umask 022).

    Raises:
        OSError: ``path`` cannot be changed (not the owner, gone).
    """
    os.chmod(path, 0o666 & ~current_umask())
