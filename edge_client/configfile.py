"""Sectioned config files (TOML or JSON) into typed dataclasses: one section per dataclass, one key
per field, unknown sections and keys refused. Shared by `dropfl sim`'s config and the edge agent's
(which must not import the coordinator).

Every value is checked against its field before anything runs (`check_value`): the type comes from
the field's annotation (`int`, `float`, `str`, `bool`, `X | None`, `list[X]`), the range from the
field's metadata where it has one (`minimum`, `maximum` inclusive; `gt`, `lt` exclusive; `choices`).
bool is not an int, an int is fine for a float (and becomes one), a string is never a number, and
floats must be finite. A bad value gives one line naming the key, the value and where it came from:

    data.clients must be an integer ≥ 1 (got "abc" in run.toml)

Plain stdlib on purpose: the agent runs on 512 MB boards, and the coordinator's dataclasses already
generate the CLI and its help (see coordinator/config.py for why this is not pydantic).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import sys
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 (a Jetson's JetPack 6 system Python): the same parser from PyPI (pyproject: tomli)
    import tomli as tomllib


def read_config_file(path: str | Path, error: type[Exception], option: str = "--config") -> dict:
    """Parse `path` as JSON (by its .json suffix) or TOML; failures raise `error` with one line."""
    p = Path(path)
    kind = "JSON" if p.suffix == ".json" else "TOML"
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise error(f"{option}: cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise error(f"{option}: {path} is not a UTF-8 text file (byte {e.start}: {e.reason}); "
                    f"give a {kind} config file") from None
    try:
        data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise error(f"{option}: {path} is not valid {kind}: {e}") from None
    except RecursionError:
        raise error(f"{option}: {path} is not valid {kind}: nested too deeply") from None
    if not isinstance(data, dict):
        raise error(f"{option}: {path} must hold a table of sections ({{\"data\": {{...}}, ...}}), "
                    f"not {show(data, 30)}")
    return data


def fill_sections(sections: dict[str, Callable[[], object]], data: dict, error: type[Exception],
                  where: str = "--config", source: str | None = None) -> dict[str, object]:
    """A default instance per section, with the file's values checked (`check_value`) and set on it;
    unknown names and bad values raise `error`. `source` names the file in messages (default: `where`)."""
    src = f" in {source}" if source else ""
    unknown = set(data) - set(sections)
    if unknown:
        raise error(f"{where}: unknown section(s) {sorted(unknown)}{src} (expected {list(sections)})")
    parts = {}
    for name, factory in sections.items():
        obj = factory()
        fields = {f.name: f for f in dataclasses.fields(obj)}
        values = data.get(name, {})
        if not isinstance(values, dict):
            raise error(f"{where}: section {name}{src} must be a table of keys")
        hints = field_types(type(obj))
        for k, v in values.items():
            if k not in fields:
                near = difflib.get_close_matches(str(k), list(fields), n=1)
                hint = f"did you mean {name}.{near[0]}?" if near else f"{name} has: {', '.join(fields)}"
                raise error(f"{where}: unknown key {name}.{k}{src} ({hint})")
            v = check_value(f"{name}.{k}", v, hints.get(k), fields[k].metadata, f"in {source or where}", error)
            setattr(obj, k, v)
        parts[name] = obj
    return parts


@functools.cache
def field_types(cls: type) -> dict[str, object]:
    """The evaluated annotations of a dataclass (they are strings under `from __future__ import annotations`)."""
    try:
        return typing.get_type_hints(cls)
    except Exception:  # an annotation that cannot be evaluated: no type checks for that class
        return {}


def check_value(key: str, value, hint, meta: Mapping | None = None, where: str = "",
                error: type[Exception] = ValueError, choices: Sequence | None = None):
    """`value` as the field `key` of type `hint` holds it (an int becomes a float for a float field), or
    `error("KEY must be EXPECTED (got VALUE WHERE)")`. `meta`: the field's metadata (`minimum`, `maximum`,
    `gt`, `lt`, `choices`); `choices` overrides the metadata's; `where`: "in FILE", "from --flag" or ""."""
    meta = meta or {}
    choices = choices if choices is not None else meta.get("choices")
    if isinstance(value, str) and "\x00" in value:  # names and paths: the OS refuses NUL in a path
        raise error(f"{key} must be a string without NUL characters (got {show(value)}{' ' + where if where else ''})")
    ok, out = _conform(value, hint)
    if ok and choices and out is not None and out not in choices:
        ok = False
    if ok and isinstance(out, (int, float)) and not isinstance(out, bool) and not _in_range(out, meta):
        ok = False
    if ok:
        return out
    raise error(f"{key} must be {expectation(hint, meta, choices)} (got {show(value)}{' ' + where if where else ''})")


def _split_optional(hint) -> tuple[object, bool]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return (args[0] if len(args) == 1 else None), len(args) < len(typing.get_args(hint))
    return hint, False


def _conform(value, hint) -> tuple[bool, object]:
    base, optional = _split_optional(hint)
    if value is None:
        return optional, None
    if base is bool:
        return isinstance(value, bool), value
    if base is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if base is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return False, value
        return True, float(value)
    if base is str:
        return isinstance(value, str), value
    if typing.get_origin(base) is list:
        if not isinstance(value, list):
            return False, value
        (item,) = typing.get_args(base) or (None,)
        done = [_conform(v, item) for v in value]
        return all(ok for ok, _ in done), [v for _, v in done]
    return True, value  # a type this checker does not know: left to the code that uses it


def _in_range(v: float, meta: Mapping) -> bool:
    lo, hi, gt, lt = (meta.get(k) for k in ("minimum", "maximum", "gt", "lt"))
    return ((lo is None or v >= lo) and (hi is None or v <= hi) and (gt is None or v > gt)
            and (lt is None or v < lt))


_PLURAL = {bool: "booleans", int: "integers", float: "finite numbers", str: "strings"}


def expectation(hint, meta: Mapping | None = None, choices: Sequence | None = None) -> str:
    """What a field accepts, in words: "an integer ≥ 1", "a finite number in (0, 1]", "one of: a, b"."""
    meta = meta or {}
    if choices:
        return "one of: " + ", ".join(map(str, choices))
    base, _ = _split_optional(hint)
    if base is bool:
        return "true or false"
    if base is str:
        return "a string"
    if typing.get_origin(base) is list:
        (item,) = typing.get_args(base) or (None,)
        return "a list" + (f" of {_plural(item)}" if _plural(item) else "")
    if base not in (int, float):
        return "valid"
    what = "an integer" if base is int else "a finite number"
    return f"{what} {_range_text(meta, base is int)}".rstrip()


def _plural(hint) -> str:
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint) or (None,)
        return "lists" + (f" of {_plural(item)}" if _plural(item) else "")
    return _PLURAL.get(hint, "")


def _range_text(meta: Mapping, integer: bool) -> str:
    lo, hi, gt, lt = (meta.get(k) for k in ("minimum", "maximum", "gt", "lt"))
    if integer and lo is not None and hi is not None:
        return f"in {lo}..{hi}"
    low = f"[{_num(lo)}" if lo is not None else f"({_num(gt)}" if gt is not None else None
    high = f"{_num(hi)}]" if hi is not None else f"{_num(lt)})" if lt is not None else None
    if low and high:
        return f"in {low}, {high}"
    if low:
        return ("≥ " if lo is not None else "> ") + low[1:]
    if high:
        return ("≤ " if hi is not None else "< ") + high[:-1]
    return ""


def _num(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def show(value, limit: int = 60) -> str:
    """A value as the user wrote it: strings in double quotes, true/false, null, inf, nan."""
    if isinstance(value, bool):
        s = "true" if value else "false"
    elif value is None:
        s = "null"
    elif isinstance(value, (int, float)):
        s = repr(value)
    else:
        try:
            s = json.dumps(value, ensure_ascii=False, default=str)
        except (TypeError, ValueError):  # NaN inside a list and the like
            s = repr(value)
    return s if len(s) <= limit else s[:limit - 1] + "…"
