"""A recipe's pydantic validation errors as one line per problem, each naming the file and line (or the
command-line override) and the field: unknown fields first, with the closest known name."""

from __future__ import annotations

import re
import typing
from typing import Any

import yaml

from zerorun.recipe.overrides import override_for
from zerorun.recipe.text import line_of
from zerorun.recipe.values import is_number_text


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


def _elsewhere(model: Any, key: str, loc: tuple) -> list[str]:
    """The dotted names of the fields called ``key`` at the top of the recipe or in its sections (``precision``,
    ``train.activation_checkpointing``), but the one at ``loc``: where a field put in the wrong section lives."""
    found = [key] if key in _fields_at(model, ()) else []
    for section in _fields_at(model, ()):
        if key in _fields_at(model, (section,)):
            found.append(f"{section}.{key}")
    return [name for name in found if tuple(name.split(".")) != loc]


def _number_choice(text: str, expected: str) -> bool:
    """Whether the number ``text`` (a quoted one) is one of pydantic's ``expected`` choices ("0, 1, 2 or 3"):
    only then would removing the quotes help."""
    choices = re.split(r", | or ", expected)
    try:
        return any(float(text.replace("_", "")) == float(c) for c in choices if is_number_text(c))
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
            other = _elsewhere(model, str(loc[-1]), loc) if model and not close else []
            if close or other:  # a typo in its section, or the right name in another (zero.precision)
                msg += f" (did you mean {(close or other)[0]!r}?)"
        elif err["type"] == "missing":
            msg = "required field is missing"
        elif err["type"] == "literal_error" and is_number_text(err.get("input")) and \
                _number_choice(err["input"], str(err.get("ctx", {}).get("expected", ""))):
            # zero.stage: '2' was "Input should be 0, 1, 2 or 3", which reads as if 2 were refused
            msg = f"{err['input']!r} is text (quoted?): expected {err['ctx']['expected']}"
        elif err["type"] == "list_type" and isinstance(err.get("input"), str):  # zero.units: Block
            msg = f"expected a list: [{err['input']}] (got the text {err['input']!r})"
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
