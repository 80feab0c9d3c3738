"""A plugin's own options: a `@dataclass` named `Options` on the plugin (docs/extending.md, "Plugin options").

    @dataclass
    class Options:
        momentum: float = field(default=0.9, metadata={"help": "server momentum β"})
        nesterov: bool = False
        schedule: Literal["constant", "cosine"] = "constant"

        def __post_init__(self):
            if not 0 <= self.momentum < 1:
                raise ValueError(f"momentum must be in [0, 1) (got {self.momentum})")

An option's type is one of `int`, `float`, `bool`, `str`, `Literal[...]` (of str, int or bool values) or one of
them `| None`. A value is converted by that type: from a command-line `key=value` (`parse`: "0.9", "true", "none")
or as a config file or the API gives it (`conform`: a TOML float, a JSON bool). The same rules as the built-in
options: a bool is not a number, an int is fine for a float (and becomes one), floats are finite, a string is
never a number in a file. What `__post_init__` raises as ValueError is the plugin's own check of its values.

Plain stdlib, on the device side (it never imports `coordinator`), as edge_client/configfile.py.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass

BASES = (int, float, bool, str)
SUPPORTED = "int, float, bool, str, Literal[...] of str/int/bool, or one of them | None"
NONE_WORDS = ("none", "null")
TRUE_WORDS, FALSE_WORDS = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


class OptionsError(ValueError):
    """A plugin's Options class, or a value given for it, that cannot be used; the message says what to fix."""


@dataclass(frozen=True)
class Spec:
    """One option: its name, base type, Literal choices, whether None is allowed, its default, its help."""
    name: str
    base: type                   # int, float, bool or str (a Literal's: the type of its values)
    choices: tuple | None        # Literal[...]'s values
    optional: bool
    default: object              # dataclasses.MISSING: the option is required
    help: str = ""

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING

    def type_text(self) -> str:
        """The type as a user reads it: float, bool, a|b (a Literal's values), int|none."""
        t = "|".join(map(text, self.choices)) if self.choices else self.base.__name__
        return t + ("|none" if self.optional else "")

    def expectation(self) -> str:
        """What the option takes, in words: "a float (a finite number)", "one of: a, b", "... or none"."""
        if self.choices:
            what = "one of: " + ", ".join(map(text, self.choices))
        else:
            what = {int: "an integer", float: "a float (a finite number)", bool: "true or false",
                    str: "a string"}[self.base]
        return what + (", or none" if self.optional else "")

    def short(self) -> str:
        """`name (type, default value)`, for messages."""
        default = "required" if self.required else f"default {text(self.default)}"
        return f"{self.name} ({self.type_text()}, {default})"

    def describe(self) -> str:
        """`name (type, default value): help`, for listings."""
        return self.short() + (f": {self.help}" if self.help else "")


def text(v) -> str:
    """A value as a user types it: true, none, 0.9."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "none"
    return f"{v:g}" if isinstance(v, float) else str(v)


def options_class(obj: object) -> type | None:
    """The `Options` dataclass that the plugin `obj` declares, or None. OptionsError if `Options` is not a
    dataclass, or one of its fields has a type options cannot take (`specs` checks every field)."""
    cls = getattr(obj, "Options", None)
    if cls is None:
        return None
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise OptionsError(f"its Options is {_describe(cls)}, not a @dataclass class: declare Options as a "
                           f"@dataclass whose fields have types and defaults")
    specs(cls)
    return cls


def _describe(obj) -> str:
    return f"the class {obj.__name__}" if isinstance(obj, type) else f"a {type(obj).__name__}"


def specs(cls: type) -> list[Spec]:
    """The options of the Options dataclass `cls`, in field order (fields with init=False are not options)."""
    try:
        hints = typing.get_type_hints(cls, include_extras=False)
    except Exception as e:   # an annotation that does not evaluate (a name the module does not import)
        raise OptionsError(f"the types of its Options do not evaluate ({type(e).__name__}: {e}): import what "
                           f"they name in the plugin's module") from None
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        base, choices, optional = _split(hints.get(f.name, f.type))
        if base is None:
            raise OptionsError(f"its option {f.name} has the type {_hint_text(hints.get(f.name, f.type))}, which an "
                               f"option cannot take: use {SUPPORTED}")
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        help_ = f.metadata.get("help", "") if isinstance(f.metadata, Mapping) else ""
        out.append(Spec(f.name, base, choices, optional, default, str(help_)))
    return out


def _hint_text(hint) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def _split(hint) -> tuple[type | None, tuple | None, bool]:
    """(base type, Literal choices, optional) of a supported annotation; base None where it is not supported."""
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        if len(args) != 1:
            return None, None, optional
        hint = args[0]
    if typing.get_origin(hint) is typing.Literal:
        values = typing.get_args(hint)
        kinds = {type(v) for v in values}
        if not values or len(kinds) != 1 or kinds.pop() not in (str, int, bool):
            return None, None, optional
        return type(values[0]), tuple(values), optional
    if hint in BASES:
        return hint, None, optional
    return None, None, optional


def conform(spec: Spec, value):
    """`value` (from a config file or the API) as the option holds it; ValueError if the option cannot take it."""
    if value is None:
        if spec.optional:
            return None
        raise ValueError(spec.expectation())
    if spec.base is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        value = float(value) if ok else value
    elif spec.base is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif spec.base is str:
        ok = isinstance(value, str) and "\x00" not in value   # the OS refuses NUL in a path or a name
    else:
        ok = isinstance(value, spec.base)
    if ok and spec.choices is not None:
        ok = any(type(value) is type(c) and value == c for c in spec.choices)
    if not ok:
        raise ValueError(spec.expectation())
    return value


def parse(spec: Spec, raw: str):
    """The command line's text `raw` (of key=value) converted by the option's type; ValueError if it cannot be."""
    raw = str(raw)   # a str subclass (config.Text) as a plain str
    word = raw.strip().lower()
    if spec.optional and word in NONE_WORDS:
        return None
    if spec.base is bool:
        if word in TRUE_WORDS or word in FALSE_WORDS:
            return conform(spec, word in TRUE_WORDS)
    elif spec.base is int:
        try:
            return conform(spec, int(raw.strip(), 10))
        except ValueError:
            pass
    elif spec.base is float:
        try:
            return conform(spec, float(raw))
        except ValueError:
            pass
    else:
        return conform(spec, raw)
    raise ValueError(spec.expectation())


def build(cls: type, values: Mapping[str, object]):
    """`cls(**values)`: the plugin's Options instance; what its `__post_init__` raises (ValueError, TypeError)
    becomes OptionsError with its message."""
    try:
        return cls(**values)
    except (ValueError, TypeError) as e:
        lines = str(e).strip().splitlines()
        raise OptionsError(lines[0] if lines else type(e).__name__) from e

