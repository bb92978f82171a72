"""The console entry point (``zerorun.cli:main``): the typer app run with zerorun's argument fix-ups, and every
failure as one ``zerorun: error:`` line with its exit code."""

from __future__ import annotations

import os
import sys

from zerorun.cli.app import app
from zerorun.errors import ZerorunError


def _err(message: str) -> None:
    sys.stderr.write("".join(f"zerorun: error: {line}\n" for line in message.splitlines() or [""]))
    sys.stderr.flush()


def optional_value(argv: list[str], option: str, default: str) -> list[str]:
    """``argv`` with ``option`` given ``default`` where it has no value of its own (typer options always take
    one): at the end, before another option, before a ``FIELD=VALUE`` override that is not a path, or before a
    recipe (``zerorun train --resume r.yaml`` took the recipe for the checkpoint, then said "Missing argument
    'RECIPE'": a new user's review)."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == option:
            nxt = out[i + 1] if i + 1 < len(out) else None
            if nxt is None or nxt.startswith("-") or ("=" in nxt and not os.path.exists(nxt)) or (
                    nxt.lower().endswith((".yaml", ".yml")) and not os.path.isdir(nxt)):
                out[i] = f"{option}={default}"
    return out


def split_sbatch_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """``zerorun submit``'s arguments and, after its ``--``, the extra sbatch arguments (click would mix them
    into the overrides); other commands' ``argv`` unchanged, with no sbatch arguments."""
    if argv[:1] == ["submit"] and "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return argv, []


def main() -> None:
    """Console entry point: run the typer app; a :class:`ZerorunError` becomes one line and its exit code."""
    try:
        argv, sbatch_args = split_sbatch_args(optional_value(sys.argv[1:], "--resume", "latest"))
        # prog_name: `python -m zerorun` too is `zerorun` in usage lines and in the shell completion it installs
        code = app(args=argv, prog_name="zerorun", standalone_mode=False, obj={"sbatch_args": sbatch_args})
        if isinstance(code, int) and code:  # typer.Exit(code): attach passes on the job's exit status
            if code == 130:  # typer returns 130 for a KeyboardInterrupt (Ctrl-C), as a job stopped by it exits
                _err("interrupted")
            sys.exit(code)
    except ZerorunError as e:
        _err(str(e))
        sys.exit(e.exit_code)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        _err("interrupted")
        sys.exit(130)
    except Exception as e:  # click's (typer's) usage errors: one line, as every other bad input
        code = _usage_error(e)
        if code is None:
            raise
        sys.exit(code)


def _usage_error(e: Exception) -> int | None:
    """Write click's (typer's) error ``e`` as one line and return its exit code (0: a bare ``zerorun``, whose
    help is printed); None when ``e`` is not click's. An unknown option that names a recipe field gets the
    override that sets it (cli/suggest.py); one of ``zerorun submit``'s, where sbatch's options go."""
    name = type(e).__name__
    if name == "NoArgsIsHelpError":  # a bare `zerorun`: the help, on stdout as -h prints it; nothing failed
        print(e.format_message(), flush=True)
        return 0
    ctx = getattr(e, "ctx", None)
    if name == "NoSuchOption":
        hint = _field_hint(ctx, e.option_name)
        if hint is not None:
            option = e.option_name  # click's close matches only where one name extends the other (--stages)
            maybe = sorted(p for p in getattr(e, "possibilities", None) or () if p.startswith(option)
                           or option.startswith(p))
            _err(f"No such option: {e.option_name}" + (f" (did you mean {' or '.join(maybe)}?)" if maybe else "")
                 + hint)
            return 2
        from zerorun.cli.suggest import torchrun_hint

        torchrun = torchrun_hint(sys.argv, e.option_name)
        if torchrun is not None:
            _err(f"No such option: {e.option_name}{torchrun}")
            return 2
        if sys.argv[1:2] == ["submit"]:
            from zerorun.slurm.submit import misplaced_option

            _err(misplaced_option(sys.argv[1:], e.option_name))
            return 2
    if hasattr(e, "format_message") and hasattr(e, "exit_code"):
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        _err(" ".join(e.format_message().split()) + hint)
        return e.exit_code
    if name == "Abort":
        _err("aborted")
        return 130
    return None


def _field_hint(ctx, option: str) -> str | None:
    """:func:`zerorun.cli.suggest.override_hint` for ``option`` where the command takes recipe overrides."""
    if ctx is None or not any(p.name == "overrides" for p in ctx.command.params):
        return None
    from zerorun.cli.suggest import override_hint

    return override_hint(sys.argv[1:], option)
