"""Recipe text before it is a :class:`~zerorun.recipe.Recipe`: reading the file, YAML bounded against alias
bombs, the line of a field, ``a.b=value`` overrides, booleans refused as numbers, and the masking of
``launch.env`` values in the copies written to disk (Note [Masked environment values]).

Split from ``recipe.py`` (pydantic models and resolution), which re-exports what it always offered.
"""

from __future__ import annotations

import math
import re
import sys
import types
import typing
from typing import Any, Callable

import yaml
from pydantic import ValidationInfo
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


def admits_bool(annotation: Any) -> bool:
    """Whether a field of this type means to take ``true``/``false`` (bool, ``bool | None``, Any)."""
    if annotation is bool or annotation is Any:
        return True
    return any(admits_bool(a) for a in typing.get_args(annotation) if a is not type(None))


def _text_choices(annotation: Any) -> list[str]:
    """The text values of the ``Literal`` types in ``annotation`` (``Optional[Literal["fp32", "bf16"]]``)."""
    if typing.get_origin(annotation) is typing.Literal:
        return [a for a in typing.get_args(annotation) if isinstance(a, str)]
    return [c for a in typing.get_args(annotation) for c in _text_choices(a)]


def _shape(annotation: Any) -> str | None:
    """What a field of ``annotation`` takes when that is not a number: "text" (``str``, ``str | None``), "a
    list" or "a mapping" (the first of a union's members that is one), else None."""
    if annotation is str:
        return "text"
    origin = typing.get_origin(annotation)
    if origin in (list, tuple, set, frozenset):
        return "a list"
    if origin is dict or isinstance(annotation, type) and hasattr(annotation, "model_fields"):  # zero: off
        return "a mapping"
    if origin in (typing.Union, types.UnionType):
        return next((shape for a in typing.get_args(annotation) if (shape := _shape(a))), None)
    return None


def refuse_bool(cls, value: Any, info: ValidationInfo) -> Any:
    """pydantic takes ``true`` as 1 for an int, float or ``Literal[0, 1, ...]`` field: refuse it instead. A field
    of text (``precision``, ``zero.offload_optimizer``) is told what it takes and that YAML reads an unquoted
    ``off``/``no`` as a boolean (it was told "expected a number")."""
    if isinstance(value, bool) and info.field_name in cls.model_fields and \
            not admits_bool(cls.model_fields[info.field_name].annotation):
        annotation = cls.model_fields[info.field_name].annotation
        choices, shape = [repr(c) for c in _text_choices(annotation)], _shape(annotation)
        if choices or shape:
            expected = f"{', '.join(choices[:-1])} or {choices[-1]}" if len(choices) > 1 else \
                choices[0] if choices else shape
            raise PydanticCustomError("bool_not_text", "expected {expected}, got a boolean ({value}): YAML reads an "
                                      "unquoted yes/no/on/off/true/false as one", {"expected": expected,
                                                                                   "value": str(value).lower()})
        raise PydanticCustomError("bool_not_number", "expected a number, got a boolean ({value})",
                                  {"value": str(value).lower()})
    return value


def first_leaf(value: Any, test: Callable[[Any], bool], path: str = "") -> tuple[str, Any] | None:
    """The first leaf of ``value`` (nested lists, tuples and mappings, in order) for which ``test`` is true, as
    ``(its path, like "rev" or "betas.0", the leaf)``, or None."""
    if test(value):
        return path, value
    items = enumerate(value) if isinstance(value, (list, tuple)) else value.items() if isinstance(value, dict) else ()
    for key, v in items:
        found = first_leaf(v, test, f"{path}.{key}" if path else str(key))
        if found:
            return found
    return None


def _is_non_finite(value: Any) -> bool:
    """An infinite or NaN float, or a whole number too large for a float."""
    return isinstance(value, float) and not math.isfinite(value) or \
        isinstance(value, int) and not isinstance(value, bool) and abs(value) > sys.float_info.max


#: A finite number as YAML writes one (digits, a dot, an exponent; ``_`` between digits), ASCII only.
_NUMBER_TEXT = re.compile(r"[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?")


def _is_number_text(value: Any) -> bool:
    """A string that YAML would have read as a finite number without its quotes (``"1e-8"``, ``" 0.9"``), not
    other text that Python's ``float`` also reads (``"Infinity"``, ``"nan"``)."""
    return isinstance(value, str) and _NUMBER_TEXT.fullmatch(value.strip()) is not None


#: Words YAML 1.1 reads as booleans when they are not quoted (any case).
BOOLEAN_WORDS = frozenset({"true", "false", "yes", "no", "on", "off"})


def _is_boolean_text(value: Any) -> bool:
    """A string that YAML would have read as a boolean without its quotes (``"false"``, ``"Off"``)."""
    return isinstance(value, str) and value.strip().lower() in BOOLEAN_WORDS


def non_finite(value: Any) -> tuple[str, Any] | None:
    """The first infinite or NaN number in ``value`` (a whole number too large for a float counts), as ``(its
    path, the number)``, or None: :func:`first_leaf`."""
    return first_leaf(value, _is_non_finite)


def _finite_error(found: tuple[str, Any], at: str = "") -> PydanticCustomError:
    path, value = found
    shown = str(value) if isinstance(value, float) else f"a whole number of {len(str(abs(value)))} digits"
    # no context: the message is the user's text (a key named "{shown}"), never a template to fill
    return PydanticCustomError("finite_number", f"{at or (path + ': ' if path else '')}expected a finite number, "
                                                f"got {shown}")


def optimizer_argument(value: Any) -> Any:
    """Check one of the optimizer's extra arguments (``eps``, ``betas``, ``momentum``, ...; any nesting) before
    anything starts: no infinite or NaN number (it would reach the ranks as JSON null), and no number or boolean
    written as text: ``eps: "1e-8"`` failed on every rank inside the optimizer after the launch, and
    ``maximize: "false"`` trained with ``maximize`` on (a non-empty string is true). No ``torch.optim`` class
    takes either as text. What type the argument takes is the optimizer check's (``check_arguments`` in
    ``zero/optimizers.py``), so the message does not guess it. Used as the validator of
    :class:`zerorun.recipe.OptimizerSpec`'s extra keys, so each key's problem is reported on its own line, at the
    key's line.

    Raises:
        PydanticCustomError: ``finite_number`` or ``quoted_value``; a nested value's position is named
        (``betas``: "item 0: ...").
    """
    def at(path: str) -> str:
        return f"item {path}: " if path else ""

    found = non_finite(value)
    if found:
        raise _finite_error(found, at(found[0]))
    found = first_leaf(value, lambda v: _is_number_text(v) or _is_boolean_text(v))
    if found:  # no context: the message holds the user's text
        raise PydanticCustomError("quoted_value", f"{at(found[0])}{found[1]!r} is text (quoted?): numbers and "
                                                  "true/false are written without quotes")
    return value


def finite_values(cls, value: Any) -> Any:
    """Refuse an infinite or NaN number anywhere in a free-form field (``model.kwargs``, ``data.kwargs``,
    ``model.hf.config``), naming the key path inside it (``a.b.1``)."""
    found = non_finite(value)
    if found:
        raise _finite_error(found)
    return value


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

class _UnboundedYaml(ZerorunError):
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
            raise _UnboundedYaml(f"{path}: invalid YAML: an alias refers to itself (a recursive structure)")
        if size > MAX_YAML_NODES:
            raise _UnboundedYaml(f"{path}: invalid YAML: its aliases expand to more than {MAX_YAML_NODES} nodes "
                               "(an alias bomb?)")
        return yaml.load(text, Loader=RecipeLoader), root  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise ZerorunError(f"{path}{where}: invalid YAML: {getattr(e, 'problem', None) or e}") from None
    except RecursionError:
        raise _UnboundedYaml(f"{path}: invalid YAML: nested too deeply") from None


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b.c=value`` overrides (value parsed as YAML: ``3``, ``1e-3``, ``true``, ``[1, 2]``) to ``data``.

    Raises:
        ZerorunError: an override without ``=`` or whose path crosses a non-mapping value.
    """
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ZerorunError(f"override {item!r}: expected FIELD=VALUE, e.g. train.steps=50")
        try:
            value, written = load_yaml(raw, f"override {item!r}") if raw else ("", None)
        except _UnboundedYaml:
            raise
        except ZerorunError:
            value, written = raw, None
        node = data
        parts = key.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ZerorunError(f"override {item!r}: {'.'.join(parts[:i + 1])} is not a mapping")
            node = child
        if len(parts) == 3 and parts[:2] == ["launch", "env"] and isinstance(value, (int, float)) \
                and not isinstance(value, bool):
            value = raw.strip()  # a number for an environment variable: keep its text (``010`` stays ``010``)
        elif parts in (["launch"], ["launch", "env"]):  # launch={env: {X: 010}}, launch.env={X: 1e5}: the same
            env = value.get("env") if parts == ["launch"] and isinstance(value, dict) else value
            keep_number_texts(env, _mapping(written).get("env") if parts == ["launch"] else written)
        node[parts[-1]] = value
    return data


_MERGE = "tag:yaml.org,2002:merge"


def _items(node: yaml.Node, memo: dict) -> list:
    """``(key text, value node)`` pairs of a YAML mapping node in the order PyYAML's ``flatten_mapping`` gives
    them, so that the last pair of a key is the value the loaded mapping holds: merged pairs (``<<``; of a
    list of mappings, the earlier mapping's after the later one's; of two ``<<`` keys, the later one's last)
    before the node's own keys, duplicates kept. ``memo``: node id -> pairs (a mapping merged many times
    through aliases is flattened once)."""
    if id(node) in memo:
        return memo[id(node)]
    merged, own = [], []
    for k, v in node.value:
        if k.tag == _MERGE:
            subs = [v] if isinstance(v, yaml.MappingNode) else \
                [m for m in v.value if isinstance(m, yaml.MappingNode)] if isinstance(v, yaml.SequenceNode) else []
            for m in reversed(subs):
                merged.extend(_items(m, memo))
        else:
            own.append((k.value, v))
    memo[id(node)] = merged + own
    return memo[id(node)]


def _mapping(node: yaml.Node | None) -> dict:
    """Key text -> value node of a YAML mapping node, as the loaded mapping has them (merge keys followed, the
    last duplicate kept); empty for anything else."""
    return dict(_items(node, {})) if isinstance(node, yaml.MappingNode) else {}


def keep_number_texts(env: Any, node: yaml.Node | None) -> None:
    """Replace each number in the mapping ``env`` (``launch.env`` as loaded) by its text as written in ``node``,
    the YAML mapping node it was loaded from (``1``, ``010``, ``1.50``, ``1e5``; merge keys followed)."""
    if not isinstance(env, dict):
        return
    written = _mapping(node)
    for key, value in env.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            text = written.get(key)
            if isinstance(text, yaml.ScalarNode):
                env[key] = text.value


def env_numbers_as_text(data: dict, root: yaml.Node | None) -> dict:
    """``data`` with each number under ``launch.env`` (``OMP_NUM_THREADS: 1``) replaced by its text as written in
    the YAML (``1``, ``010``, ``1.50``), as docker-compose takes numbers in ``environment:``; booleans, nulls,
    lists and mappings are left for :func:`env_value_text` to refuse."""
    launch = data.get("launch")
    keep_number_texts(launch.get("env") if isinstance(launch, dict) else None,
                      _mapping(_mapping(root).get("launch")).get("env"))
    return data


def env_value_text(env: Any) -> Any:
    """``launch.env`` with numbers as their decimal text (``1`` -> ``"1"``; those of a YAML file keep their
    written text, :func:`env_numbers_as_text`).

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
    zerorun/zero/allocator.py).

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


def override_for(loc: tuple, overrides: list[str]) -> str | None:
    """The last command-line override that set the field at ``loc`` or one of its parents, if any."""
    field = ".".join(str(p) for p in loc)
    for item in reversed(overrides):
        key = item.partition("=")[0]
        if field == key or field.startswith(key + ".") or key.startswith(field + "."):
            return item
    return None


def _fields_at(model: Any, loc: tuple) -> list[str]:
    """Field names of the pydantic model reached from ``model`` by the keys ``loc`` (``[]`` when ``loc`` leads
    to no model: a mapping of free keys, a list)."""
    for key in loc:
        field = getattr(model, "model_fields", {}).get(key)
        if field is None:
            return []
        kinds = [a for a in (field.annotation, *typing.get_args(field.annotation)) if hasattr(a, "model_fields")]
        if not kinds:
            return []
        model = kinds[0]
    return list(getattr(model, "model_fields", {}))


def _number_choice(text: str, expected: str) -> bool:
    """Whether the number ``text`` (a quoted one) is one of pydantic's ``expected`` choices ("0, 1, 2 or 3"):
    only then would removing the quotes help."""
    choices = re.split(r", | or ", expected)
    try:
        return any(float(text.replace("_", "")) == float(c) for c in choices if _is_number_text(c))
    except ValueError:
        return False


def validation_problems(errors: list[dict], path: str, root: yaml.Node | None, overrides: list[str],
                        model: Any = None) -> list[str]:
    """One line per problem pydantic found in a recipe (``ValidationError.errors()``), each naming where it
    comes from (``path:line`` or the override) and the field: unknown fields first (with the closest known
    name of their section when one is close: a typo also makes its field "missing"), then in file order.
    ``model``: the pydantic class validated, for the known names."""
    import difflib

    lines: list[list] = []  # [not an unknown field, line, where and field, messages]
    for err in errors:
        loc = tuple(err["loc"])
        if loc and isinstance(loc[-1], str) and _UNION_TAG.fullmatch(loc[-1]) and model is not None \
                and loc[-1] not in _fields_at(model, loc[:-1]):
            loc = loc[:-1]  # one member of a union (str | dict): said once for the field, members joined by "or"
        field = ".".join(str(p) for p in loc) or "(top level)"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
            close = difflib.get_close_matches(str(loc[-1]), _fields_at(model, loc[:-1]), n=1) if model else []
            if close:
                msg += f" (did you mean {close[0]!r}?)"
        elif err["type"] == "missing":
            msg = "required field is missing"
        elif err["type"] == "literal_error" and _is_number_text(err.get("input")) and \
                _number_choice(err["input"], str(err.get("ctx", {}).get("expected", ""))):
            # zero.stage: '2' was "Input should be 0, 1, 2 or 3", which reads as if 2 were refused
            msg = f"{err['input']!r} is text (quoted?): expected {err['ctx']['expected']}"
        if err.get("input") == "auto" and err["type"] != "literal_error":
            msg = "'auto' (a value the HF Trainer fills in: zerorun import-deepspeed lists it): give a value"
        source = override_for(loc, overrides)
        line = line_of(root, loc) if source is None else None
        where = f"override {source!r}" if source is not None else f"{path}{f':{line}' if line else ''}"
        head = f"{where}: {field}"
        same = next((entry for entry in lines if entry[2] == head), None)
        if same is None:
            lines.append([err["type"] != "extra_forbidden", line or 0, head, [msg]])
        elif msg not in same[3]:
            same[3].append(msg.removeprefix("Input should be ") if same[3][0].startswith("Input should be ") else msg)
    return [f"{head}: {' or '.join(msgs)}" for *_, head, msgs in sorted(lines, key=lambda x: x[:2])]


#: How pydantic names the member of a union in an error's location: ``str``, ``dict[str,any]``, ``literal['a']``.
_UNION_TAG = re.compile(r"(str|int|float|bool|none|bytes|dict\[.*\]|list\[.*\]|tuple\[.*\]|literal\[.*\]|"
                        r"function-\w+\[.*\]|[A-Z]\w*)")
