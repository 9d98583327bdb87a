"""The README's configuration table against the config schema (config/*.py): every setting documented, nothing
documented that does not exist, and numeric defaults as the schema has them."""

from __future__ import annotations

import re

from pydantic import BaseModel

from config.schema import PROJECT_ROOT, RepositoryConfig, ServingConfig


def documented_rows() -> dict[str, str]:
    """`section.field` (or a top-level `field`) -> the row's default cell; a cell like `agents.a` / `b`
    names agents.a and agents.b."""
    text = (PROJECT_ROOT / "README.md").read_text()
    table = text[text.index("| key | default | meaning |") :].split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines()[2:]:
        keys, default = [cell.strip() for cell in line.strip("|").split("|")[:2]]
        names = re.findall(r"`([\w.]+)`", keys)
        section = names[0].split(".")[0]
        for name in names:
            rows[name if "." in name or "." not in names[0] else f"{section}.{name}"] = default
    return rows


def schema_fields() -> dict[str, object]:
    """`section.field` of every section, and the top-level fields that are not sections: those of
    the one-model form and the repository form's `models` (its default: none)."""
    defaults = ServingConfig()
    fields: dict[str, object] = {"models": []}
    for section, info in ServingConfig.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            for name in info.annotation.model_fields:
                fields[f"{section}.{name}"] = getattr(getattr(defaults, section), name)
        else:
            fields[section] = getattr(defaults, section)
    assert set(RepositoryConfig.model_fields) - set(ServingConfig.model_fields) == {"models"}
    return fields


def test_every_setting_is_documented_and_every_documented_one_exists():
    documented, fields = set(documented_rows()), set(schema_fields())
    assert sorted(fields - documented) == [], "settings missing from the README's table"
    assert sorted(documented - fields) == [], "README rows for settings that do not exist"


def test_numeric_defaults_match_the_schema():
    rows = documented_rows()
    wrong = {
        name: (rows[name], value)
        for name, value in schema_fields().items()
        if isinstance(value, (int, float))
        and not isinstance(value, bool)
        and (str(value) if isinstance(value, int) else f"{value:g}") not in rows[name].replace(",", "")
    }
    assert wrong == {}
