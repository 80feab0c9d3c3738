"""Sectioned config files (TOML or JSON) into typed dataclasses: one section per dataclass, one key
per field, unknown sections and keys refused. Shared by `dropfl sim`'s config and the edge agent's
(which must not import the coordinator)."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from collections.abc import Callable
from pathlib import Path


def read_config_file(path: str | Path, error: type[Exception], option: str = "--config") -> dict:
    """Parse `path` as JSON (by its .json suffix) or TOML; failures raise `error` with one line."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise error(f"{option}: cannot read {path}: {e.strerror}") from None
    try:
        return json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise error(f"{option}: {path} is not valid {'JSON' if p.suffix == '.json' else 'TOML'}: {e}") from None


def fill_sections(sections: dict[str, Callable[[], object]], data: dict, error: type[Exception],
                  where: str = "--config") -> dict[str, object]:
    """A default instance per section, with the file's values set on it; unknown names raise `error`."""
    unknown = set(data) - set(sections)
    if unknown:
        raise error(f"{where}: unknown section(s) {sorted(unknown)} (expected {list(sections)})")
    parts = {}
    for name, factory in sections.items():
        obj = factory()
        fields = {f.name for f in dataclasses.fields(obj)}
        values = data.get(name, {})
        if not isinstance(values, dict):
            raise error(f"{where}: section {name} must be a table of keys")
        for k, v in values.items():
            if k not in fields:
                raise error(f"{where}: unknown key {name}.{k}")
            setattr(obj, k, v)
        parts[name] = obj
    return parts
