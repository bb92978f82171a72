"""Recipe text before it is a :class:`~zerorun.recipe.Recipe`: reading the file, YAML bounded against alias
bombs, the line of a field, duplicate keys, the checks of ``launch.env`` (names, values, sizes) and the masking
of its values in the copies written to disk (Note [Masked environment values]).

The ``a.b=value`` overrides are ``overrides.py``; the pydantic value validators (booleans refused as numbers,
finite numbers) ``values.py``; pydantic's errors as one line per problem ``problems.py``.
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from pydantic_core import PydanticCustomError

from zerorun.errors import ZerorunError
from zerorun.allocator import ALLOCATOR_VAR, allocator_problem

#: What a ``launch.env`` value is written as in a run folder's recipe.yaml and a checkpoint's zerorun.json
#: (Note [Masked environment values]).
MASK = "<masked>"
#: A POSIX environment variable name: the only ``launch.env`` keys accepted (they reach a remote shell).
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # use fullmatch: "$" also matches before a final "\n"
#: Linux's limit on one string of a new process's environment or arguments, ``KEY=VALUE`` and its final NUL
#: included (MAX_ARG_STRLEN = 32 pages of 4 KiB, include/uapi/linux/binfmts.h): a longer one makes exec fail
#: with "Argument list too long".
MAX_ENV_STRING = 32 * 4096


def env_string_bytes(key: str, value: str) -> int:
    """Bytes of ``KEY=VALUE`` in a process's environment (UTF-8, final NUL included); compare with
    :data:`MAX_ENV_STRING`."""
    return len(key.encode()) + 1 + len(value.encode("utf-8", "surrogateescape")) + 1


#: The most YAML nodes a recipe may stand for once its aliases are followed (a few hundred in practice): an
#: "alias bomb" of a few lines stands for billions and would hang the loader.
MAX_YAML_NODES = 100_000


def line_of(root: yaml.Node | None, path: tuple) -> int | None:
    """1-based line of the YAML node at ``path`` (keys and list indices), or of its nearest parent."""
    node, line = root, None
    for key in path:
        if node is None:
            break
        line = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            nxt = None
            for k, v in node.value:
                if k.value == str(key):
                    nxt = v
                    line = k.start_mark.line + 1
            node = nxt
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
            line = node.start_mark.line + 1
        else:
            node = None
    return line


def masked(data: dict[str, Any]) -> dict[str, Any]:
    """A copy of the recipe ``data`` (JSON-able, as ``model_dump``) with every ``launch.env`` value replaced by
    :data:`MASK`.

    Note [Masked environment values]: ``launch.env`` carries secrets (tokens, passwords), so the copies of the
    recipe that stay on disk (the run folder's ``recipe.yaml``, a checkpoint's ``zerorun.json``) hold the
    keys with the value :data:`MASK`. Nothing reads the values back from them: ``--resume`` takes
    ``launch.env`` from the recipe given on its command line, never from the checkpoint, and a recipe whose
    ``launch.env`` holds :data:`MASK` (one copied from a run folder) is refused at load, so a masked value
    can never silently replace the real one.
    """
    launch = data.get("launch")
    if not isinstance(launch, dict) or not isinstance(launch.get("env"), dict):
        return data
    return {**data, "launch": {**launch, "env": {k: MASK for k in launch["env"]}}}


def masked_yaml(recipe) -> str:
    """``recipe`` (a :class:`~zerorun.recipe.Recipe`) as the YAML text of a run folder's ``recipe.yaml``:
    resolved, ``launch.env`` values masked (Note [Masked environment values])."""
    import json

    return yaml.safe_dump(masked(json.loads(recipe.model_dump_json())), sort_keys=False)


class UnboundedYaml(ZerorunError):
    """YAML that would take unbounded time or memory to load (an alias bomb, a recursive alias)."""


def _yaml_size(root: yaml.Node | None, limit: int) -> int:
    """Nodes the YAML graph at ``root`` stands for with aliases followed (shared nodes counted once per
    reference), stopping past ``limit``; ``-1`` for a recursive alias. Linear in the graph's size."""
    if root is None:
        return 0
    memo: dict[int, int] = {}
    open_: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        kids = [x for pair in node.value for x in pair] if isinstance(node, yaml.MappingNode) else \
            node.value if isinstance(node, yaml.SequenceNode) else []
        if done:
            open_.discard(id(node))
            memo[id(node)] = min(limit + 1, 1 + sum(memo[id(k)] for k in kids))
            continue
        if id(node) in memo:
            continue
        if id(node) in open_:
            return -1
        open_.add(id(node))
        stack.append((node, True))
        for k in kids:
            if id(k) in open_:
                return -1
            if id(k) not in memo:
                stack.append((k, False))
    return memo[id(root)]


class RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader (no Python objects), reading a number in exponent notation without a dot (``1e-8``,
    ``5e8``) as a float, as YAML 1.2 and JSON do: YAML 1.1, which PyYAML implements, reads it as a string, so
    ``eps: 1e-8`` reached the optimizer as text and ``zero.prefetch_bytes: 5e8`` was refused. A whole number
    so written fills an integer field (``train.steps: 1e3`` is 1000); a fraction there is pydantic's one-line
    error naming the field."""


RecipeLoader.add_implicit_resolver(  # appended after 1.1's resolvers: only what none of them matched
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def load_yaml(text: str, path: str) -> tuple[Any, yaml.Node | None]:
    """``(data, root node)`` of the YAML ``text`` read from ``path`` (:class:`RecipeLoader`), bounded: aliases
    may not make it stand for more than :data:`MAX_YAML_NODES` nodes, nor refer to themselves; nesting too deep
    is an error too.

    Raises:
        ZerorunError: invalid YAML (naming the line), an alias bomb, a recursive alias, too deep.
    """
    try:
        root = yaml.compose(text, Loader=RecipeLoader)
        size = _yaml_size(root, MAX_YAML_NODES)
        if size < 0:
            raise UnboundedYaml(f"{path}: invalid YAML: an alias refers to itself (a recursive structure)")
        if size > MAX_YAML_NODES:
            raise UnboundedYaml(f"{path}: invalid YAML: its aliases expand to more than {MAX_YAML_NODES} nodes "
                                "(an alias bomb?)")
        return yaml.load(text, Loader=RecipeLoader), root  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise ZerorunError(f"{path}{where}: invalid YAML: {getattr(e, 'problem', None) or e}") from None
    except RecursionError:
        raise UnboundedYaml(f"{path}: invalid YAML: nested too deeply") from None


def env_value_text(env: Any) -> Any:
    """``launch.env`` with numbers as their decimal text (``1`` -> ``"1"``; those of a YAML file keep their
    written text, :func:`~zerorun.recipe.overrides.env_numbers_as_text`).

    Raises:
        PydanticCustomError: a boolean, null, list or mapping value, with the hint to quote it.
    """
    if not isinstance(env, dict):
        return env
    out = {}
    for key, value in env.items():
        if isinstance(value, bool):
            raise PydanticCustomError("env_value", "{key}: {value} is a YAML boolean, not text: quote the value: "
                                      "'launch.env.{key}: \"{value}\"'", {"key": key, "value": str(value).lower()})
        if value is None:
            raise PydanticCustomError("env_value", "{key} has no value (null): give its text, e.g. "
                                      "'launch.env.{key}: \"\"' for an empty one", {"key": key})
        if isinstance(value, (list, dict)):
            kind = "a list" if isinstance(value, list) else "a mapping"
            raise PydanticCustomError("env_value", "{key} is {kind}, not text: an environment value is one string; "
                                      "quote it: 'launch.env.{key}: \"...\"'", {"key": key, "kind": kind})
        out[key] = str(value) if isinstance(value, (int, float)) else value
    return out


#: The variable each rank reads for its thread count (``torch.set_num_threads``), as torchrun sets it.
THREADS_VAR = "OMP_NUM_THREADS"


def env_value_problem(key: str, value: str) -> str | None:
    """Why ``value`` cannot be the rank environment's ``key``, for the variables zerorun itself reads:
    ``ZERORUN_ALLOCATOR`` (Note [Rank allocator]) and ``OMP_NUM_THREADS`` (a positive whole number; empty is
    unset), or None. Checked where a rank's environment comes from (``launch.env``, the environment files)
    before anything starts; the launcher's own ``OMP_NUM_THREADS`` never reaches a rank (each node's plan sets
    it, ``launch/plan.py``)."""
    if key == ALLOCATOR_VAR:
        return allocator_problem(value)
    if key == THREADS_VAR and value.strip() and not re.fullmatch(r"[1-9][0-9]*", value.strip()):
        return (f"{THREADS_VAR} is {value!r}: expected a positive whole number of threads per rank (e.g. 4), as "
                "torch.set_num_threads takes it")
    return None


def check_env(env: dict[str, str]) -> dict[str, str]:
    """``launch.env`` after its values became text (:func:`env_value_text`): POSIX names, no NUL byte, each
    ``KEY=VALUE`` within :data:`MAX_ENV_STRING` bytes, no :data:`MASK` value (Note [Masked environment values]),
    ``ZERORUN_ALLOCATOR`` one of ``auto``, ``tcmalloc``, ``mimalloc``, ``glibc`` (Note [Rank allocator] in
    zerorun/allocator.py).

    Raises:
        PydanticCustomError: naming the key and the problem (pydantic puts the field in front).
    """
    for key, value in env.items():
        if not isinstance(key, str) or not ENV_NAME.fullmatch(key):
            raise PydanticCustomError("env_name", "key {key} is not a variable name ([A-Za-z_][A-Za-z0-9_]*)",
                                      {"key": repr(key)})
        if "\0" in value:
            raise PydanticCustomError("env_nul", "{key}: the value holds a NUL byte, which no environment "
                                      "variable can carry", {"key": key})
        if env_string_bytes(key, value) > MAX_ENV_STRING:
            raise PydanticCustomError(
                "env_too_long", "{key}: KEY=VALUE is {n} bytes, above Linux's limit of {limit} bytes for one "
                "environment string (MAX_ARG_STRLEN): the ranks could not start",
                {"key": key, "n": env_string_bytes(key, value), "limit": MAX_ENV_STRING})
        if problem := env_value_problem(key, value):
            raise PydanticCustomError("env_value", problem.replace("{", "{{").replace("}", "}}"))
        if value == MASK:
            raise PydanticCustomError(
                "env_masked", "{key} is {mask}, the mask zerorun writes for launch.env values in run folders "
                "and checkpoints: give the real value", {"key": key, "mask": repr(MASK)})
    return env


def read_text(path: str, what: str) -> str:
    """The UTF-8 text of ``path``.

    Raises:
        ZerorunError: unreadable (missing, a directory, no permission) or not UTF-8 text.
    """
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ZerorunError(f"{path}: cannot read {what}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ZerorunError(f"{path}: cannot read {what}: not UTF-8 text (byte {e.start})") from None


def check_duplicate_keys(node: yaml.Node | None, path: str) -> None:
    """YAML keeps the last of two equal keys silently; a recipe with both is almost always a mistake."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for k, v in node.value:
            key = getattr(k, "value", None)
            if isinstance(key, str):
                if key in seen:
                    raise ZerorunError(f"{path}:{k.start_mark.line + 1}: {key}: duplicate key "
                                       f"(first on line {seen[key]})")
                seen[key] = k.start_mark.line + 1
            check_duplicate_keys(v, path)
    elif isinstance(node, yaml.SequenceNode):
        for v in node.value:
            check_duplicate_keys(v, path)
