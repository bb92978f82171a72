"""One rank's swap file for disk offload (Note [Swap files] in ``offload.py``)."""

from __future__ import annotations

import fcntl
import glob
import os
import weakref

import torch

from zerorun.zero.paging_math import SWAP_ALIGN, swap_region_bytes  # noqa: F401 (SWAP_ALIGN re-exported)

_PREFIX = "zerorun-offload-"


def remove_stale_swap_files(folder: str) -> list[str]:
    """Remove swap files in ``folder`` whose owner is gone (no process holds their ``flock``: Note [Swap
    files]). Returns the removed paths."""
    removed = []
    for path in sorted(glob.glob(os.path.join(folder, _PREFIX + "*.bin"))):
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a live run owns it
        finally:
            os.close(fd)
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def _close_and_remove(fd: int, path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    os.close(fd)


class SwapFile:
    """One rank's swap file under ``folder`` (Note [Swap files]; ``tag`` tells the parameters' file,
    ``"params-"``, from the optimizer's): fixed regions allocated by
    :meth:`allocate`, read and written with positional I/O (``os.preadv``/``os.pwrite``), so the page cache,
    not this process's resident memory, holds what was written.

    Raises:
        OSError: ``folder`` cannot be created or written.
    """

    def __init__(self, folder: str, rank: int, tag: str = "") -> None:
        os.makedirs(folder, exist_ok=True)
        # The scan and the creation of our locked file happen under one folder lock, so a rank starting at
        # the same moment never takes our new file for a stale one.
        lock = os.open(os.path.join(folder, f".{_PREFIX}lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.removed_stale = remove_stale_swap_files(folder)
            for n in range(1, 1 << 16):  # a second engine of this process and rank gets its own file
                name = f"{_PREFIX}{tag}rank{rank}-{os.getpid()}{'' if n == 1 else f'-{n}'}.bin"
                self.path = os.path.join(folder, name)
                try:
                    self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                    break
                except FileExistsError:
                    continue
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(lock)
        self.size = 0
        self._finalizer = weakref.finalize(self, _close_and_remove, self.fd, self.path)

    def allocate(self, nbytes: int) -> int:
        """A new region of ``nbytes`` bytes; returns its offset (64-byte aligned)."""
        offset = self.size
        self.size += swap_region_bytes(nbytes)
        os.ftruncate(self.fd, self.size)
        return offset

    def write(self, offset: int, t: torch.Tensor) -> None:
        """Write the bytes of ``t`` (contiguous, CPU) at ``offset``."""
        view = memoryview(t.detach().contiguous().view(torch.uint8).numpy()).cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], offset + done)

    def read_into(self, offset: int, t: torch.Tensor) -> None:
        """Fill ``t`` (contiguous, CPU) with the bytes at ``offset``."""
        view = memoryview(t.view(torch.uint8).numpy()).cast("B")
        done = 0
        while done < len(view):
            n = os.preadv(self.fd, [view[done:]], offset + done)
            if n == 0:
                raise OSError(f"{self.path}: unexpected end of file at byte {offset + done}")
            done += n

    def close(self) -> None:
        """Close and remove the file (also done at process exit)."""
        self._finalizer()
