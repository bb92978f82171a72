"""Pydantic value validators of the recipe's models: booleans refused where a number or text is meant
(YAML reads an unquoted ``off`` as one), and infinite or NaN numbers refused anywhere (they would reach the
ranks as JSON null); :class:`Strict`, the base of every recipe section."""

from __future__ import annotations

import math
import re
import sys
import types
import typing
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from zerorun.errors import INT64_MAX


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


def is_number_text(value: Any) -> bool:
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
    found = first_leaf(value, lambda v: is_number_text(v) or _is_boolean_text(v))
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


def within_int64(cls, value: Any) -> Any:
    """Refuse a whole number beyond a signed 64-bit integer in any field (Note [Integer bounds] in errors.py)."""
    if isinstance(value, int) and not isinstance(value, bool) and not -INT64_MAX - 1 <= value <= INT64_MAX:
        bound = f"at most {INT64_MAX}" if value > 0 else f"at least {-INT64_MAX - 1}"
        raise PydanticCustomError("int64", f"expected a whole number {bound} (64 bits), got a whole number of "
                                           f"{len(str(abs(value)))} digits")
    return value


class Strict(BaseModel):
    """The base of a recipe section: unknown keys refused, no ``.inf``/``.nan`` (YAML's would pass and then
    reach the ranks as null through JSON), no boolean for a number or text (:func:`refuse_bool`), no whole
    number beyond 64 bits (:func:`within_int64`)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    _no_bool_numbers = field_validator("*", mode="before")(classmethod(refuse_bool))
    _int64 = field_validator("*", mode="after")(classmethod(within_int64))
