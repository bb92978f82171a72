"""No whole number beyond 64 bits anywhere (Note [Integer bounds] in zerorun/errors.py): every integer field of
the recipe and every integer option of the CLI refuses one with a line naming the field or flag, exit code 2.
``train.steps: 99999999999999999999999`` and ``zerorun bench --warmup 100000000000000000000`` were accepted."""

from __future__ import annotations

import os
import typing

import pytest
import typer

from zerorun.errors import ZerorunError
from zerorun.errors import INT64_MAX
from zerorun.recipe import Recipe
from zerorun.recipe.load import load_recipe

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "recipes/tiny.yaml")


def _takes_int(annotation) -> bool:
    return annotation is int or any(_takes_int(a) for a in typing.get_args(annotation))


def _integer_fields(model, prefix: str = "") -> list[str]:
    """The dotted names of every field of ``model`` (and its sections) that takes a whole number."""
    found = []
    for name, field in model.model_fields.items():
        for a in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(a, type) and hasattr(a, "model_fields"):
                found += _integer_fields(a, f"{prefix}{name}.")
        if _takes_int(field.annotation):
            found.append(prefix + name)
    return found


FIELDS = _integer_fields(Recipe)


def test_the_fields_are_found():
    assert {"train.steps", "train.micro_batch_size", "train.seed", "checkpoint.every", "log.every"} <= set(FIELDS)


@pytest.mark.parametrize("field,value,bound", [(f, v, f"at most {INT64_MAX}") for f in FIELDS
                                               if f != "launch.procs_per_node"  # its own bound: 4096
                                               for v in (10**23, INT64_MAX + 1)]
                         + [("train.seed", -10**23, f"at least {-INT64_MAX - 1}")])  # the one without a lower bound
def test_every_integer_field_refuses_more_than_64_bits(field, value, bound):
    with pytest.raises(ZerorunError) as e:
        load_recipe(TINY, [f"{field}={value}"])
    digits = len(str(abs(value)))
    assert str(e.value) == (f"override '{field}={value}': {field}: expected a whole number {bound} (64 bits), got "
                            f"a whole number of {digits} digits")
    assert e.value.exit_code == 2


def _integer_options():
    from zerorun.cli.app import app

    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        for sub, cmd in getattr(command, "commands", {name: command}).items():
            for p in cmd.params:
                descriptor = getattr(p, "type_descriptor", None)  # typer's own parameters
                if p.opts[0].startswith("-") and descriptor is not None and _takes_int(descriptor.annotation):
                    yield f"{name} {sub}" if sub != name else name, p


def test_every_integer_option_has_a_64_bit_bound():
    options = list(_integer_options())
    assert {(c, p.opts[0]) for c, p in options} >= {("bench", "--warmup"), ("train", "--max-restarts"),
                                                     ("estimate", "--nodes")}
    unbounded = [f"{c} {p.opts[0]}" for c, p in options if p.max is None or p.max > INT64_MAX]
    assert unbounded == []


@pytest.mark.parametrize("args,flag", [(["bench", TINY, "--warmup", "100000000000000000000"], "'--warmup'"),
                                       (["train", TINY, "--max-restarts", str(INT64_MAX + 1)],
                                        "'--max-restarts' / '--max_restarts'"),
                                       (["estimate", "--params", "7B", "--micro-batch", str(10**30)],
                                        "'--micro-batch'")])
def test_a_cli_integer_beyond_64_bits_is_one_line_exit_2(capsys, monkeypatch, args, flag):
    from zerorun import cli

    monkeypatch.setattr("sys.argv", ["zerorun", *args])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 2
    assert capsys.readouterr().err == (f"zerorun: error: Invalid value for {flag}: Input should be less than or "
                                       f"equal to {INT64_MAX} (see 'zerorun {args[0]} --help')\n")
