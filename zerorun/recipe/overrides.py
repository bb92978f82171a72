"""Command-line overrides of a recipe (``a.b.c=value``, the value read as YAML), which of them set a field
(so that errors name the override instead of the file's line), and the text of numbers in ``launch.env`` as
written (``010`` stays ``010``)."""

from __future__ import annotations

from typing import Any

import yaml

from zerorun.errors import ZerorunError
from zerorun.recipe.text import UnboundedYaml, load_yaml


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
        except UnboundedYaml:
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


def override_for(loc: tuple, overrides: list[str]) -> str | None:
    """The last command-line override that set the field at ``loc`` or one of its parents, if any."""
    field = ".".join(str(p) for p in loc)
    for item in reversed(overrides):
        key = item.partition("=")[0]
        if field == key or field.startswith(key + ".") or key.startswith(field + "."):
            return item
    return None
