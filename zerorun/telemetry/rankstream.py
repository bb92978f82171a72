"""A rank's ``sys.stdout`` and ``sys.stderr``: real text streams that prefix each line with ``[rank R]``.

Note [Rank streams]: the ranks of a node share one pipe to the launcher, so each rank's output lines are
prefixed with ``[rank R]`` and written whole, one ``write(2)`` per batch of complete lines (a pipe keeps a write
of up to ``PIPE_BUF`` bytes unbroken), and the telemetry events (telemetry/events.py), written to the real
stdout, never land inside a line. A script run by ``zerorun launch`` must see the same streams it sees under
torchrun: ``sys.stdout`` is an ``io.TextIOWrapper`` (``encoding``, ``errors``, ``reconfigure``,
``writelines``, ``line_buffering``, ...) over :class:`LineBuffer`, a binary stream, so ``sys.stdout.buffer.write``
gets the same prefixing, and ``fileno()`` is the real descriptor (``faulthandler.enable()`` and
``subprocess.run(..., stdout=sys.stdout)`` write to it directly, unprefixed, as under torchrun).
The prefix is added in the process, not by a thread reading a pipe swapped onto fd 1/2: such a thread dies with
the process, so a crash's last words (faulthandler's dump on SIGSEGV, a C library's message before abort)
would be lost, where here they go straight to the launcher's pipe.
A line without its newline waits for the rest (``print(..., end="")`` then ``print()`` is one line); whatever is
left is written, with a newline, when the stream is flushed at the end (:func:`finish`) or closed.
"""

from __future__ import annotations

import io
import os
import sys
from typing import TextIO


class LineBuffer(io.BufferedIOBase):
    """A write-only binary stream over descriptor ``fd`` (not owned: closing this leaves it open) that writes
    each complete line as ``prefix + line``, several lines in one ``os.write`` (Note [Rank streams]).

    Args:
        fd: the descriptor written to (1 or 2).
        prefix: bytes put before every line, e.g. ``b"[rank 3] "``.
    """

    def __init__(self, fd: int, prefix: bytes, name: str = "") -> None:
        super().__init__()
        self._fd, self._prefix, self.pending = fd, prefix, b""
        self.name = name  # as the real stream's: "<stdout>"

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return os.isatty(self._fd)

    def write(self, data) -> int:
        """Write ``data`` (bytes-like); complete lines go out now, a last partial line waits. Returns its
        length in bytes. Raises ValueError when closed, OSError from ``os.write``."""
        if self.closed:
            raise ValueError("write to closed file")
        data = memoryview(data).tobytes()  # TypeError for what is not bytes-like, as a real buffer
        if b"\n" in data:
            *lines, rest = (self.pending + data).split(b"\n")
            self.pending = rest
            self._write_all(b"".join(self._prefix + line + b"\n" for line in lines))
        else:
            self.pending += data
        return len(data)

    def finish(self) -> None:
        """Write a partial last line, with a newline (nothing when there is none)."""
        if self.pending:
            line, self.pending = self.pending, b""
            self._write_all(self._prefix + line + b"\n")

    def close(self) -> None:
        if not self.closed:
            try:
                self.finish()
            finally:
                super().close()

    def _write_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]


def rank_stream(original: TextIO, rank: int) -> TextIO:
    """A text stream over ``original``'s descriptor that prefixes lines with ``[rank R]`` (Note [Rank
    streams]), with ``original``'s encoding and error handler; ``original`` itself is returned when it has no
    descriptor (a test's ``io.StringIO``)."""
    try:
        fd = original.fileno()
    except (AttributeError, OSError, ValueError):
        return original
    original.flush()
    buffer = LineBuffer(fd, f"[rank {rank}] ".encode(), getattr(original, "name", fd))
    stream = io.TextIOWrapper(buffer, encoding=original.encoding, errors=original.errors, write_through=True)
    stream.mode = "w"  # as io.open sets it on the real one
    return stream


def install(rank: int) -> None:
    """Make ``sys.stdout`` and ``sys.stderr`` rank streams over the real ones (``sys.__stdout__`` and
    ``sys.__stderr__`` stay the real ones: telemetry events go there)."""
    if sys.__stdout__ is not None:
        sys.stdout = rank_stream(sys.__stdout__, rank)
    if sys.__stderr__ is not None:
        sys.stderr = rank_stream(sys.__stderr__, rank)


def finish() -> None:
    """Flush ``sys.stdout`` and ``sys.stderr`` and write any partial last line (at a rank's end)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
            buffer = getattr(stream, "buffer", None)
            if isinstance(buffer, LineBuffer):
                buffer.finish()
        except (OSError, ValueError):  # closed by the script, or the launcher's pipe is gone
            pass
