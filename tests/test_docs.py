"""README.md and the docs/ site: short README, no broken relative link or anchor, every page in mkdocs.yml's nav,
every design note of the code in the notes index. Pure and fast: runs without mkdocs (``mkdocs build --strict`` in
.ci/run checks the site's links again, with the theme)."""

from __future__ import annotations

import os
import re
import unicodedata

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
README_MAX_LINES = 250

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans (a link written in code is not a link)."""
    return _CODE.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """The anchor Python-Markdown's ``toc`` extension (MkDocs' default) gives a heading; GitHub's is the same
    for the headings these pages use."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading: its text
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(path: str) -> set[str]:
    """The heading anchors of the Markdown file ``path``, and explicit ``id="..."`` ones."""
    text = _FENCE.sub("", open(path, encoding="utf-8").read())
    found = {slug(m.group(2)) for m in _HEADING.finditer(text)}
    return found | set(re.findall(r"\bid=\"([^\"]+)\"", text))


def broken_links(md_file: str, root: str = ROOT, excused: set[str] = frozenset()) -> list[str]:
    """``"file: target (why)"`` for each relative link in ``md_file`` whose file (or heading anchor, for a link
    into a Markdown file) does not exist. Links with a scheme (``https:``, ``mailto:``) are not followed.
    ``excused``: root-relative paths whose links are accepted while the file is missing."""
    text = _prose(open(md_file, encoding="utf-8").read())
    bad = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(md_file), path)) if path else md_file
        where = os.path.relpath(md_file, root)
        rel = os.path.relpath(dest, root).replace(os.sep, "/")
        if path and not os.path.exists(dest):
            if rel not in excused:
                bad.append(f"{where}: {target} (no such file {rel})")
            continue
        if path.startswith("/") or rel.startswith("../"):
            bad.append(f"{where}: {target} (outside the repository or absolute)")
        elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
            bad.append(f"{where}: {target} (no heading #{anchor} in {rel})")
    return bad


def _pages() -> list[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(DOCS) for f in files if f.endswith(".md"))


def test_readme_is_short():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move text to docs/"


def test_relative_links_resolve():
    files = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "benchmarks", "results", "history.md"), *_pages()]
    bad = [b for f in files for b in broken_links(f)]
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_broken_links_are_found(tmp_path):
    """The checker itself: a missing file, a missing anchor and a link out of the tree are reported; code is not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "b.md").write_text("# B page\n\n## Bench: `zerorun bench`\n")
    page = tmp_path / "docs" / "a.md"
    page.write_text("[ok](b.md) [ok](b.md#bench-zerorun-bench) [web](https://x.org/y)\n"
                    "[gone](c.md) [no anchor](b.md#nope) [out](../../etc/passwd)\n"
                    "`[code](d.md)`\n\n```\n[fenced](e.md)\n```\n")
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "passwd").write_text("")
    bad = broken_links(str(page), str(tmp_path / "docs"))
    assert [b.split(": ", 1)[1].split(" ")[0] for b in bad] == ["c.md", "b.md#nope", "../../etc/passwd"]
    assert broken_links(str(page), str(tmp_path / "docs"), excused={"c.md"})[0].startswith("a.md: b.md#nope")


def _nav_pages(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [p for v in nav.values() for p in _nav_pages(v)]
    return [p for item in nav for p in _nav_pages(item)]


def test_every_code_block_is_closed():
    """Every fenced code block of README.md and docs/ is closed: an unclosed one turns the rest of the page into
    code on GitHub and into one paragraph in the site (mkdocs build --strict does not see it)."""
    for path in [os.path.join(ROOT, "README.md"), *_pages()]:
        with open(path, encoding="utf-8") as f:
            fences = [line for line in f.read().splitlines() if re.match(r"^\s*(```|~~~)", line)]
        assert len(fences) % 2 == 0, f"{os.path.relpath(path, ROOT)}: a code block is never closed"


def test_contributing_names_every_test_file():
    """docs/contributing.md tells where the tests of each package live: every tests/test_*.py is in it."""
    with open(os.path.join(DOCS, "contributing.md"), encoding="utf-8") as f:
        text = f.read()
    files = sorted(f for f in os.listdir(os.path.join(ROOT, "tests")) if re.fullmatch(r"test_\w+\.py", f))
    assert [f for f in files if f"`{f}`" not in text] == [], "test files missing from docs/contributing.md"


def test_every_page_is_in_the_nav():
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        nav = _nav_pages(yaml.safe_load(f)["nav"])
    pages = {os.path.relpath(p, DOCS).replace(os.sep, "/") for p in _pages()}
    assert sorted(pages - set(nav)) == [], "pages missing from mkdocs.yml's nav"
    missing = set(nav) - pages
    assert sorted(missing) == [], "nav entries without a page"
    assert len(nav) == len(set(nav))


_NOTE_DEFINED = re.compile(r"Note \[([^\]]+)\](?::| —)")
#: what may stand before a note's definition on its line (a comment, a docstring's start); a sentence's end too.
#: ``x = f()  # Note [Name]: why here`` is a reference, with a reason of its own.
_DEFINITION_START = re.compile(r"\s*(#:?\s*|r?\"\"\"\s*)?")


def _one_line(name: str) -> str:
    return re.sub(r"\s*\n\s*#?\s*", " ", name)  # a name may wrap over a comment's lines


def defined_notes(*folders: str) -> dict[str, set[str]]:
    """Every ``Note [Name]`` defined (``Note [Name]:``) in the .py files under ``folders``: name -> the files
    (paths relative to the repository) that hold it."""
    where: dict[str, set[str]] = {}
    for folder in folders:
        for d, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(d, f)
                    with open(path, encoding="utf-8") as src:
                        text = src.read()
                    for m in _NOTE_DEFINED.finditer(text):
                        before = text[text.rfind("\n", 0, m.start()) + 1:m.start()]
                        if _DEFINITION_START.fullmatch(before) or before.endswith(". "):
                            where.setdefault(_one_line(m.group(1)), set()).add(os.path.relpath(path, ROOT))
    return where


def test_notes_index_lists_every_note():
    """docs/how-it-is-built.md indexes every ``Note [Name]`` the code defines (``Note [Name]:``) with the files
    that hold it, so that a reference to a note can be looked up (regenerate the table when a note moves)."""
    defined = {name: sorted(files) for name, files in defined_notes("zerorun").items()}
    with open(os.path.join(DOCS, "how-it-is-built.md"), encoding="utf-8") as f:
        rows = re.findall(r"^\| \[([^\]]+)\] \| (.*?) \|$", f.read(), re.M)
    indexed = {name: sorted(re.findall(r"`([^`]+)`", where)) for name, where in rows}
    assert sorted(set(defined) - set(indexed)) == [], "notes missing from the index in docs/how-it-is-built.md"
    assert sorted(set(indexed) - set(defined)) == [], "notes in the index that the code no longer has"
    moved = {name: (indexed[name], files) for name, files in defined.items() if indexed[name] != files}
    assert moved == {}, "notes whose files the index names wrongly (index, code)"


def test_note_references_name_the_file_that_holds_the_note():
    """A reference to a note that names a file ("Note [Name]" then " in path.py"; in the code, the tests,
    benchmarks/ and docs/) names a file that defines the note, so that moving code cannot leave a reader looking in the wrong file."""
    where = defined_notes("zerorun", "tests", "benchmarks")
    bad = []
    for folder in ("zerorun", "tests", "benchmarks", "docs"):
        for d, _, files in os.walk(os.path.join(ROOT, folder)):
            for f in files:
                if f.endswith((".py", ".md")):
                    path = os.path.join(d, f)
                    with open(path, encoding="utf-8") as src:
                        text = src.read()
                    for m in re.finditer(r"Note \[([^\]]+)\],? in\s+(?:#:?\s*)?`{0,2}([\w/.]+\.py)", text):
                        name, ref = _one_line(m.group(1)), m.group(2)
                        if not any(h == ref or h.endswith("/" + ref) for h in where.get(name, ())):
                            bad.append(f"{os.path.relpath(path, ROOT)}: Note [{name}] in {ref}: defined in "
                                       f"{sorted(where.get(name, ())) or 'no file'}")
    assert bad == [], "\n".join(bad)


@pytest.mark.parametrize("command", ["pip install torch==2.13.0 -e . && zerorun train recipes/gpt-stdlib.yaml",
                                     "pip install torch==2.13.0 -e '.[test]' && python -m pytest -q"])
def test_readme_commands_stay(command):
    """README's two commands, and CI's last line is the second (tests/test_install.py checks CI runs it)."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert command in f.read()
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        lines = [line for line in f.read().splitlines() if line.strip()]
    assert lines[-1] == "pip install torch==2.13.0 -e '.[test]' && python -m pytest -q"


def test_the_run_folder_files_hold_what_the_docs_say(tmp_path):
    """README and getting-started said "everything the ranks printed is in output.log", which held 0 bytes after
    a run: zerorun's own lines from the ranks are telemetry events (``log``), recorded in metrics.jsonl; output.log
    holds every other line (Note [Run folder])."""
    from zerorun.telemetry.console import RunRecorder
    from zerorun.telemetry.events import Event

    rec = RunRecorder(str(tmp_path))
    rec.event(Event("log", 0, 1.0, {"message": "resumed from ckpt/step-00000010"}))
    rec.line(0, "a line of the user's code")
    rec.close()
    assert "resumed from" in (tmp_path / "metrics.jsonl").read_text()
    assert (tmp_path / "output.log").read_text() == "[node 0] a line of the user's code\n"
    for page in ("README.md", "docs/getting-started.md"):
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            text = " ".join(f.read().split())
        assert "everything the ranks printed" not in text
        assert ("metrics.jsonl`, zerorun's own lines from the ranks (`[rank 0] resumed from ...`) among them; every "
                "other line the ranks and torchrun printed") in text, page
