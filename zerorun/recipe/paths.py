"""Paths in a recipe: what a relative path is relative to, and the data files a pattern matches.

Note [Recipe paths]: a path the recipe *reads* (``model.module``, ``data.paths``, ``data.module``,
``data.path``, ``data.tokenizer``, ``model.hf.pretrained``, ``model.hf.config``) is relative to the folder of
the recipe file when written in the file, and to the working directory when given as a command-line override
(``model.module=my_model.py`` names the file you see where you type it), as docker-compose resolves its file's
paths. So a recipe and the model module beside it work from any directory, and the bundled recipes name
``models/gpt.py``. A folder the job *writes* (``log.dir``, ``checkpoint.dir``, ``zero.offload_path``) and
``launch.workdir`` (where the ranks run) are relative to the working directory, as Hugging Face's and
DeepSpeed's ``output_dir``: runs land where the command is typed. Every path is made absolute at load, so the
resolved recipe means the same on every node and in a run folder's ``recipe.yaml``.
"""

from __future__ import annotations

import glob
import os
import sysconfig


def stdlib_dir() -> str:
    """The Python standard library's source folder (``sysconfig``'s ``stdlib`` path)."""
    return sysconfig.get_paths()["stdlib"]


def _data_files(pattern: str):
    """Files matched by one data path pattern, lazily (``{stdlib}`` expanded, ``**`` recursive), without
    site-packages and dist-packages."""
    pattern = pattern.replace("{stdlib}", stdlib_dir())
    for f in glob.iglob(os.path.expanduser(pattern), recursive=True):
        parts = f.split(os.sep)
        if os.path.isfile(f) and "site-packages" not in parts and "dist-packages" not in parts:
            yield os.path.abspath(f)


def matches_any(pattern: str) -> bool:
    """True when data path ``pattern`` matches a file (as :func:`expand_data_paths` counts them); stops at
    the first one (the whole standard library's glob takes half a second)."""
    return next(_data_files(pattern), None) is not None


def expand_data_paths(patterns: list[str]) -> list[str]:
    """Files matched by ``patterns`` (``{stdlib}`` expanded, ``**`` recursive; relative patterns against the
    working directory: :func:`absolute_pattern` makes a recipe's absolute first), without site-packages and
    dist-packages, de-duplicated and sorted by path so that every machine reads the same corpus in one order."""
    return sorted({f for pattern in patterns for f in _data_files(pattern)})


def absolute(value: str, base: str) -> str:
    """``value`` (``~`` expanded) made absolute against the folder ``base``; an absolute path is kept."""
    return os.path.normpath(os.path.join(base, os.path.expanduser(value)))


def absolute_pattern(pattern: str, base: str) -> str:
    """A data glob ``pattern`` made absolute against ``base`` (its ``*?[`` taken literally); one starting with
    ``{stdlib}`` is kept."""
    if pattern.startswith("{stdlib}"):
        return pattern
    pattern = os.path.expanduser(pattern)
    return pattern if os.path.isabs(pattern) else os.path.join(glob.escape(base), pattern)


def is_file_path(value: str) -> bool:
    """A ``model.module``/``data.module`` value that names a file (``x.py``, ``a/b``) rather than a dotted
    module name (``pkg.models``)."""
    return value.endswith(".py") or os.sep in value


def not_found_hint(value: str, base: str, from_file: bool) -> str:
    """The parenthesis after "file not found: VALUE": which folder a relative ``value`` was taken against, and,
    for a recipe written for the working directory, the path that would name the same file."""
    if os.path.isabs(os.path.expanduser(value)) or value.startswith("{stdlib}"):
        return ""
    if not from_file:
        return f" (relative to the working directory {base}, as command-line overrides are)"
    hint = f" (relative to the recipe's folder {base})"
    here = os.path.abspath(os.path.expanduser(value))
    if os.path.exists(here):
        hint = (f" (paths in a recipe are relative to its folder {base}; {value} is in the working directory: "
                f"write {os.path.relpath(here, base)} or an absolute path)")
    return hint
