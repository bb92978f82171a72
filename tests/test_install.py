"""What README's install lines install: every feature the README shows works after them."""

from __future__ import annotations

import os
import re
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _project() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]


def test_plots_need_no_extra():
    """``zerorun show --plot`` and ``bench.png`` draw with matplotlib: a dependency, not an optional extra
    the README's install line leaves out."""
    names = [re.split(r"[<>=!~\[ ;]", d, maxsplit=1)[0].lower() for d in _project()["dependencies"]]
    assert "matplotlib" in names
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    assert "[plot]" not in readme  # no install line or hint asks for the extra
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read()
    assert "pip install torch==2.13.0 -e '.[test]' && python -m pytest -q" in ci  # README's test command
    assert "pip install torch==2.13.0 -e '.[test]' && python -m pytest -q" in readme
    assert "pip install torch==2.13.0 -e . && zerorun train recipes/gpt-stdlib.yaml" in readme
