"""What environment crosses to the nodes of a job.

Note [Forwarded environment]: a remote node gets only what the user asked for, never the launcher's whole
environment (DeepSpeed exports it all, secrets included): variables whose names start with one of
:data:`ALLOWED_PREFIXES`, then ``KEY=VALUE`` lines of a ``.zerorun_env`` file (``~/.zerorun_env``, then
``./.zerorun_env``, the later winning), then the recipe's ``launch.env``. Local nodes inherit the launcher's
environment as subprocesses do, plus the same file and recipe values, so a job behaves the same either way.
Values are sent to the remote shell quoted with :func:`shlex.quote` on its standard input, not on a command
line, so spaces, quotes, ``$``, ``;`` and newlines arrive byte for byte and nothing shows in ``ps``.
"""

from __future__ import annotations

import os
import re
from typing import Mapping

from zerorun.errors import ZerorunError

#: names with these prefixes are forwarded from the launcher's environment (Note [Forwarded environment]).
ALLOWED_PREFIXES = ("NCCL_", "PYTHON", "CUDA_VISIBLE_DEVICES", "GLOO_", "TORCH_", "OMP_NUM_THREADS")
ENV_FILE = ".zerorun_env"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def allowed_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables of ``environ`` (default: ``os.environ``) whose names start with an allowed prefix."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in environ.items() if k.startswith(ALLOWED_PREFIXES)}


def parse_env_file(text: str, path: str = ENV_FILE) -> dict[str, str]:
    """``KEY=VALUE`` lines; blank lines and lines starting with ``#`` are skipped; the value is everything
    after the first ``=``, taken literally (no quotes are removed, nothing is expanded).

    Raises:
        ZerorunError: a line without ``=`` or with an invalid name, as ``path:LINE: ...``.
    """
    env: dict[str, str] = {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, eq, value = line.partition("=")
        key = key.strip()
        if key.startswith("export "):
            key = key[len("export "):].strip()
        if not eq or not _NAME.match(key):
            raise ZerorunError(f"{path}:{lineno}: expected KEY=VALUE with a variable name, got {line.strip()!r}")
        env[key] = value
    return env


def env_file_values(paths: list[str] | None = None) -> dict[str, str]:
    """Values of the ``.zerorun_env`` files that exist among ``paths`` (default: home, then the current
    directory), later files overriding earlier ones."""
    from zerorun.recipe import read_text

    if paths is None:
        paths = [os.path.join(os.path.expanduser("~"), ENV_FILE), os.path.abspath(ENV_FILE)]
    env: dict[str, str] = {}
    for path in dict.fromkeys(paths):
        if os.path.isfile(path):
            env.update(parse_env_file(read_text(path, "environment file"), path))
    return env
