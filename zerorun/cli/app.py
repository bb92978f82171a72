"""The typer app: every ``zerorun`` command registered under its name, in the order ``zerorun -h`` lists them."""

from __future__ import annotations

from typing import Callable, NamedTuple

import typer

from zerorun.cli.batch import attach, submit
from zerorun.cli.jobs import launch, train
from zerorun.cli.tools import bench, consolidate, env_report, estimate, import_deepspeed, show

_NO_EXTRA = {"allow_extra_args": False}


class Command(NamedTuple):
    """One command: its function, its name on the command line and click's context settings for it."""

    run: Callable[..., None]
    name: str
    settings: dict | None = None


COMMANDS = (
    Command(env_report, "env"),
    Command(train, "train", _NO_EXTRA),
    Command(submit, "submit", _NO_EXTRA),
    Command(attach, "attach"),
    Command(consolidate, "consolidate"),
    Command(import_deepspeed, "import-deepspeed"),
    # options after the script are the script's
    Command(launch, "launch", {"allow_extra_args": True, "allow_interspersed_args": False}),
    Command(bench, "bench", _NO_EXTRA),
    Command(estimate, "estimate", _NO_EXTRA),
    Command(show, "show"),
)

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  context_settings={"help_option_names": ["-h", "--help"]},
                  help="zerorun: launch and run ZeRO data-parallel training jobs.")


def _version(value: bool) -> None:
    if value:
        import zerorun

        print(f"zerorun {zerorun.__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print zerorun's version and exit.")) -> None:
    """zerorun: launch and run ZeRO data-parallel training jobs."""


for _command in COMMANDS:
    app.command(_command.name, context_settings=_command.settings)(_command.run)
