"""What environment crosses to the nodes of a job.

Note [Forwarded environment]: a remote node gets only what the user asked for, never the launcher's whole
environment (DeepSpeed exports it all, secrets included): variables whose names start with one of
:data:`ALLOWED_PREFIXES`, then ``KEY=VALUE`` lines of environment files (:func:`env_file_paths`: DeepSpeed's
``.deepspeed_env`` where DeepSpeed looks for it, then ``~/.zerorun_env`` and ``./.zerorun_env``, the later
winning; a note on stderr names each file used), then the recipe's ``launch.env``. Local nodes inherit the launcher's
environment as subprocesses do, plus the same file and recipe values, so a job behaves the same either way.
Values are sent to the remote shell quoted with :func:`shlex.quote` on its standard input, not on a command
line, so spaces, quotes, ``$``, ``;`` and newlines arrive byte for byte and nothing shows in ``ps``.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Callable, Mapping

from zerorun.errors import ZerorunError
from zerorun.recipe.text import MAX_ENV_STRING, env_string_bytes, env_value_problem

#: names with these prefixes are forwarded from the launcher's environment (Note [Forwarded environment]).
ALLOWED_PREFIXES = ("NCCL_", "PYTHON", "CUDA_VISIBLE_DEVICES", "GLOO_", "TORCH_", "OMP_NUM_THREADS")
ENV_FILE = ".zerorun_env"
#: DeepSpeed's environment file name; ``$DS_ENV_FILE`` replaces it, as in DeepSpeed's launcher/runner.py.
DS_ENV_FILE = ".deepspeed_env"
_noted: set[str] = set()
#: a POSIX variable name; always used with ``fullmatch`` (``$`` would also match before a final newline).
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def allowed_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of ``environ`` (default: ``os.environ``) whose names start with an allowed prefix and
    are variable names (an environment may hold any name, e.g. ``NCCL_X;touch /tmp/p``: such a name would
    reach the remote shell's ``export`` unquoted, so it is not forwarded)."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k.startswith(ALLOWED_PREFIXES) and _NAME.fullmatch(k)}


def parse_env_file(text: str, path: str = ENV_FILE) -> dict[str, str]:
    """``KEY=VALUE`` lines; blank lines and lines starting with ``#`` are skipped; the value is everything
    after the first ``=``, taken literally (no quotes are removed, nothing is expanded).

    Raises:
        ZerorunError: a line without ``=`` or with an invalid name, a value holding a NUL byte, or a
            ``KEY=VALUE`` longer than Linux's limit for one environment string (``MAX_ENV_STRING``), a
            ``ZERORUN_ALLOCATOR`` that is not ``auto``, ``tcmalloc``, ``mimalloc`` or ``glibc``, as
            ``path:LINE: ...``.
    """
    env: dict[str, str] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, eq, value = line.partition("=")
        key = key.strip()
        if key.startswith("export "):
            key = key[len("export "):].strip()
        if not eq or not _NAME.fullmatch(key):
            raise ZerorunError(f"{path}:{lineno}: expected KEY=VALUE with a variable name, got {line.strip()!r}")
        if "\0" in value:
            raise ZerorunError(f"{path}:{lineno}: {key}: the value holds a NUL byte, which no environment "
                               "variable can carry")
        if env_string_bytes(key, value) > MAX_ENV_STRING:
            raise ZerorunError(f"{path}:{lineno}: {key}: KEY=VALUE is {env_string_bytes(key, value)} bytes, above "
                               f"Linux's limit of {MAX_ENV_STRING} bytes for one environment string "
                               "(MAX_ARG_STRLEN): the ranks could not start")
        if problem := env_value_problem(key, value):  # Note [Rank allocator], the thread count
            raise ZerorunError(f"{path}:{lineno}: {problem}")
        env[key] = value
    return env


def env_file_paths(environ: Mapping[str, str] | None = None) -> list[str]:
    """The environment files read, in order (later files override earlier ones): DeepSpeed's, with
    DeepSpeed's rules (``$DS_ENV_FILE`` or ``.deepspeed_env``, joined to the home folder, then to the current
    directory; an absolute ``$DS_ENV_FILE`` is that one file), then ``~/.zerorun_env`` and
    ``./.zerorun_env``, so that zerorun's own files win over a DeepSpeed user's."""
    environ = os.environ if environ is None else environ
    home = os.path.expanduser("~")
    ds_name = environ.get("DS_ENV_FILE") or DS_ENV_FILE
    paths = [os.path.join(home, ds_name), os.path.abspath(ds_name), os.path.join(home, ENV_FILE),
             os.path.abspath(ENV_FILE)]
    return list(dict.fromkeys(paths))


def env_file_values(paths: list[str] | None = None, note: Callable[[str], None] | None = None) -> dict[str, str]:
    """Values of the environment files that exist among ``paths`` (default: :func:`env_file_paths`), later
    files overriding earlier ones. ``note(message)`` is told of each file used (default: one line on stderr,
    once per file and process).

    Raises:
        ZerorunError: an unreadable file or a bad line (``path:LINE: ...``).
    """
    from zerorun.recipe import read_text

    if note is None:
        note = _note_once
    if paths is None:
        paths = env_file_paths()
    env: dict[str, str] = {}
    for path in dict.fromkeys(paths):
        if os.path.isfile(path):
            values = parse_env_file(read_text(path, "environment file"), path)
            kind = "environment file" if os.path.basename(path) == ENV_FILE else "DeepSpeed's environment file"
            note(f"zerorun: note: {len(values)} variable(s) for the ranks from {kind} {path}")
            env.update(values)
    return env


def _note_once(message: str) -> None:
    if message not in _noted:
        _noted.add(message)
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
