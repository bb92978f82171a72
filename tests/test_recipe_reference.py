"""The recipe's field reference, docs/reference/recipe-fields.md (Note [Generated field reference] in
zerorun/recipe/reference.py): every field of every recipe model has its one-line description, and the committed
page is what ``python -m zerorun.recipe.reference`` writes. Pure: no process is started."""

from __future__ import annotations

import typing
from pathlib import Path

from pydantic import BaseModel, Field

from zerorun.recipe import reference
from zerorun.recipe.model import Recipe

ROOT = Path(__file__).resolve().parents[1]


def _dotted_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every field under ``model``, nested sections included, as its dotted path."""
    out = []
    for name, field in model.model_fields.items():
        out.append(prefix + name)
        for a in (field.annotation, *typing.get_args(field.annotation)):
            if isinstance(a, type) and issubclass(a, BaseModel):
                out += _dotted_paths(a, f"{prefix}{name}.")
    return out


def test_every_recipe_field_has_a_description():
    missing = reference.missing_descriptions(Recipe)
    assert not missing, (f"recipe fields without a one-line description (Field(description=...)): "
                         f"{', '.join(missing)}")


def test_a_field_without_a_description_is_named_by_its_dotted_path():
    class Inner(BaseModel):
        described: int = Field(1, description="counted")
        bare: int = 2

    class Outer(BaseModel):
        top: str = Field("x", description="a top field")
        section: Inner | None = Field(None, description="a section")
        plain: int = 0
        blank: int = Field(0, description="  ")

    assert reference.missing_descriptions(Outer) == ["section.bare", "plain", "blank"]


def test_the_committed_page_is_what_the_generator_writes():
    page = ROOT / reference.PAGE
    assert page.is_file(), f"{reference.PAGE} is missing: run {reference.COMMAND}"
    assert page.read_text(encoding="utf-8") == reference.render(), \
        f"{reference.PAGE} differs from what the generator writes: run {reference.COMMAND} and commit it"


def test_a_row_per_field_with_type_default_allowed_values_and_meaning():
    lines = [line.split(" | ") for line in reference.render().splitlines() if line.startswith("| `")]
    rows = {cells[0].strip("|` "): cells[1:] for cells in lines}
    assert sorted(cells[0].strip("|` ") for cells in lines) == sorted(_dotted_paths(Recipe))  # each field once
    assert rows["zero.stage"][:3] == ["integer", "`0`", "`0`, `1`, `2`, `3`"]
    assert rows["train.steps"][:3] == ["integer", "required", "> 0"]
    assert rows["data.val_fraction"][:3] == ["number", "`0.01`", "≥ 0.0, < 1.0"]
    assert rows["launch.procs_per_node"][:3] == ["integer or text", "`auto`", "`auto`, `gpu`, `cpu`, or any integer"]
    assert rows["zero.grad_accum_dtype"][:3] == ["text", "`null`", "`fp32`, `bf16`, `fp16`"]
    assert rows["train.optimizer"][:2] == ["section", "(section)"]
    assert rows["zero.bucket_mb"][3].startswith("MiB of gradients")
    assert "&lt;dir&gt;/&lt;name&gt;/&lt;timestamp&gt;-&lt;job&gt;/" in rows["log.dir"][3]  # not an HTML tag in Markdown
    assert "passed on as keyword arguments" in reference.render()  # train.optimizer's extra keys


def test_check_refuses_a_stale_page_and_says_how_to_regenerate_it(tmp_path, capsys):
    page = tmp_path / "recipe-fields.md"
    assert reference.main([str(page)]) == 0
    assert page.read_text(encoding="utf-8") == reference.render()
    assert reference.main(["--check", str(page)]) == 0
    page.write_text(reference.render().replace("optimizer steps the job trains", "steps"), encoding="utf-8")
    assert reference.main(["--check", str(page)]) == 1
    assert reference.main(["--check", str(tmp_path / "absent.md")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [f"{reference.COMMAND}: error: {page} is stale: run {reference.COMMAND}",
                   f"{reference.COMMAND}: error: {tmp_path / 'absent.md'} is missing: run {reference.COMMAND}"]


def test_a_field_added_without_its_description_is_refused_by_name(tmp_path, capsys, monkeypatch):
    class WithNewField(Recipe):
        new_knob: int = 0

    monkeypatch.setattr(reference, "Recipe", WithNewField)
    page = tmp_path / "recipe-fields.md"
    assert reference.main([str(page)]) == 1
    assert not page.exists()
    assert "new_knob" in capsys.readouterr().err
