"""One registry per kind of plugin: strategy, model, dataset, partitioner, availability model.

A registry maps a name to an object (a strategy class, a model builder, a dataset loader, ...). A name
resolves, in this order:

1. a name registered in this process with `Registry.register`: the built-ins register this way, in the
   module that defines the kind (`edge_client/models.py`: `MODELS.register("mlp", mlp)`), and so can a
   user's script before it calls `dropfl.simulate`;
2. an entry point of the registry's group (`dropfl.strategies`, `dropfl.models`, `dropfl.datasets`,
   `dropfl.partitioners`, `dropfl.availability`) of an installed distribution, e.g. in its pyproject.toml

       [project.entry-points."dropfl.models"]
       resnet8 = "mynets.resnet:build_resnet8"

3. `module:attr` given as the name itself ("mynets.resnet:build_resnet8"): the module is imported from
   sys.path, its attribute is the object.

Resolving a plugin imports its module, so it runs the plugin's code: naming one in a config file runs
that code, as `import` would. A name that does not resolve raises `PluginError`, one line that says what
to fix. What is installed, and where each name comes from: `dropfl plugins` (coordinator/cli/plugins.py).

Facts about an object that other parts read by name (a model's `cpu_first`, `batch_independent`) are
declared where it is registered (`register(name, obj, cpu_first=True)`) or, for a plugin found by entry
point or `module:attr`, as attributes of the object; `Registry.meta(name, key)` reads them. This file is
the device side's (it never imports `coordinator`); the coordinator's registries use the same class.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata

BUILT_IN_PACKAGES = ("edge_client", "coordinator", "dropfl", "cvx")


class PluginError(ValueError):
    """A name that does not resolve to a plugin of its kind; the message is one line: what to fix.
    `name`: the name; `reason`: the message after "KIND 'NAME': " (for callers that name the name themselves)."""

    def __init__(self, kind: str, name: object, reason: str):
        super().__init__(f"{kind} {name!r}: {reason}")
        self.kind, self.name, self.reason = kind, name, reason

    def __reduce__(self):
        return type(self), (self.kind, self.name, self.reason)


@dataclass(frozen=True)
class Entry:
    """A resolved name: the object, where it comes from (`origin`), and its declared facts (`meta`)."""
    kind: str
    name: str
    obj: object
    origin: str          # "built-in", "entry point DIST==VERSION (module:attr)", "module M (path)", "registered by M"
    meta: Mapping[str, object] = field(default_factory=dict)


def _module_of(obj: object) -> str:
    return getattr(obj, "__module__", None) or type(obj).__module__


def _is_builtin(module: str) -> bool:
    return module.split(".")[0] in BUILT_IN_PACKAGES


def _describe(obj: object) -> str:
    if isinstance(obj, type):
        return f"the class {obj.__name__}"
    if callable(obj):
        return f"the {type(obj).__name__} {getattr(obj, '__name__', '')}".rstrip()
    return f"a {type(obj).__name__}"


class Registry(Mapping):
    """Name → object for one kind. Iterating gives the registered names, then the entry points' names;
    `registry[name]` (and `.entry(name)`) resolves any name, `module:attr` included.

    kind: what one is called in messages ("model"); group: the entry-point group ("dropfl.models");
    check: the object → None if it is one of this kind, else what it should be ("a callable (input_shape,
    num_classes, dropout) -> torch.nn.Module"); meta: the facts each entry declares, with their defaults;
    builtins: modules that register built-ins besides the one defining the registry, imported on first use."""

    def __init__(self, kind: str, group: str, *, check: Callable[[object], str | None] | None = None,
                 meta: Mapping[str, object] | None = None, builtins: Sequence[str] = ()):
        self.kind, self.group, self.check = kind, group, check
        self.meta_defaults = dict(meta or {})
        self.builtins = tuple(builtins)
        self._entries: dict[str, Entry] = {}
        self._loaded = not self.builtins

    # --- registering ------------------------------------------------------------------------------------------
    def register(self, name: str, obj: object = None, **meta):
        """Register `obj` as `name` (a built-in, or a plugin registered from a script); as a decorator without
        `obj`. `meta`: this kind's declared facts (unknown keys are refused). Returns `obj`."""
        if obj is None:
            return lambda o: self.register(name, o, **meta)
        unknown = set(meta) - set(self.meta_defaults)
        if unknown:
            raise TypeError(f"{self.kind} registry: unknown fact(s) {', '.join(sorted(unknown))} "
                            f"(known: {', '.join(self.meta_defaults) or 'none'})")
        if not name or ":" in name:
            raise ValueError(f"{self.kind} registry: a registered name cannot be empty or hold ':' (got {name!r})")
        self._fail_if_wrong_kind(name, obj)
        module = _module_of(obj)
        origin = "built-in" if _is_builtin(module) else f"registered by {module}"
        self._entries[name] = Entry(self.kind, name, obj, origin, self._meta(obj, meta))
        return obj

    def _meta(self, obj: object, given: Mapping) -> dict:
        return {k: given[k] if k in given else getattr(obj, k, d) for k, d in self.meta_defaults.items()}

    def _fail_if_wrong_kind(self, name: str, obj: object) -> None:
        why = self.check(obj) if self.check else None
        if why:
            raise PluginError(self.kind, name, f"it is {_describe(obj)}, not {why}")

    def _load_builtins(self) -> None:
        if not self._loaded:
            self._loaded = True
            for module in self.builtins:
                importlib.import_module(module)

    # --- resolving --------------------------------------------------------------------------------------------
    def entry_points(self) -> list[metadata.EntryPoint]:
        """The installed entry points of this registry's group (read afresh: sys.path may have grown)."""
        try:
            return list(metadata.entry_points(group=self.group))
        except Exception:   # a broken distribution's metadata must not stop the built-ins
            return []

    def registered(self) -> list[str]:
        self._load_builtins()
        return list(self._entries)

    def names(self) -> list[str]:
        """The names a user can pick without `module:attr`: registered, then entry points not shadowed."""
        names = self.registered()
        return names + [ep.name for ep in self.entry_points() if ep.name not in names]

    def entry(self, name: str) -> Entry:
        """Resolve `name` (registered, entry point, `module:attr`): PluginError if it does not resolve."""
        self._load_builtins()
        if not isinstance(name, str) or not name:
            raise PluginError(self.kind, name, f"no such {self.kind}: {self._choose()}")
        if name in self._entries:
            return self._entries[name]
        for ep in self.entry_points():
            if ep.name == name:
                return self._from_entry_point(ep)
        if ":" in name:
            return self._from_path(name)
        raise PluginError(self.kind, name, f"no such {self.kind}: {self._choose()}")

    def _choose(self) -> str:
        return (f"choose one of {', '.join(self.names())}, or a plugin as module:attr "
                f"(`dropfl plugins` lists what is installed)")

    @staticmethod
    def _ep_origin(ep: metadata.EntryPoint) -> str:
        dist = getattr(ep, "dist", None)
        where = f"{dist.metadata['Name']}=={dist.version}" if dist is not None else "an unknown distribution"
        return f"entry point {where} ({ep.value})"

    def _from_entry_point(self, ep: metadata.EntryPoint) -> Entry:
        dist = getattr(ep, "dist", None)
        where = f"{dist.metadata['Name']}=={dist.version}" if dist is not None else "an unknown distribution"
        try:
            obj = ep.load()
        except Exception as e:
            raise PluginError(self.kind, ep.name, f"entry point {ep.value} of {where} (group {self.group}) "
                              f"does not load ({type(e).__name__}: {_first_line(e)}): reinstall or fix "
                              f"that distribution") from None
        self._fail_if_wrong_kind(ep.name, obj)
        return Entry(self.kind, ep.name, obj, self._ep_origin(ep), self._meta(obj, {}))

    def _from_path(self, name: str) -> Entry:
        module_name, _, attr = name.partition(":")
        if not module_name or not attr:
            raise PluginError(self.kind, name, "a plugin is named module:attr, e.g. mypkg.mod:MyClass")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
                raise PluginError(self.kind, name, f"no module named {e.name!r}: install it, or put the "
                                  f"directory that holds it on PYTHONPATH") from None
            raise PluginError(self.kind, name, f"module {module_name} does not import "
                              f"(ModuleNotFoundError: {_first_line(e)}): install what it needs") from None
        except Exception as e:   # a plugin's own error at import (SyntaxError included)
            raise PluginError(self.kind, name, f"module {module_name} does not import "
                              f"({type(e).__name__}: {_first_line(e)}): fix the module") from None
        obj = module
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise PluginError(self.kind, name, f"module {module_name} has no attribute {attr!r}: "
                                  f"check the name after ':'")
            obj = getattr(obj, part)
        self._fail_if_wrong_kind(name, obj)
        return Entry(self.kind, name, obj, f"module {module_name} ({getattr(module, '__file__', None) or '?'})",
                     self._meta(obj, {}))

    def listing(self) -> list[tuple[str, str]]:
        """(name, where it comes from) for every registered name and installed entry point, for `dropfl plugins`.
        Loads each entry point (so runs its code): one that does not load, or is of the wrong kind, says why;
        one whose name a registered name takes is listed as shadowed."""
        rows = [(e.name, e.origin) for e in (self._entries[n] for n in self.registered())]
        for ep in self.entry_points():
            if ep.name in self._entries:
                rows.append((ep.name, f"{self._ep_origin(ep)}: shadowed by the {self._entries[ep.name].origin} "
                                      f"{self.kind} of that name (rename the entry point)"))
                continue
            try:
                rows.append((ep.name, self._from_entry_point(ep).origin))
            except PluginError as e:
                rows.append((ep.name, f"error: {e.reason}"))
        return rows

    def meta(self, name: str, key: str):
        """A declared fact of the entry `name` (its default for a name that does not resolve)."""
        try:
            return self.entry(name).meta[key]
        except PluginError:
            return self.meta_defaults[key]

    # --- Mapping ----------------------------------------------------------------------------------------------
    def __getitem__(self, name: str):
        try:
            return self.entry(name).obj
        except PluginError as e:
            if isinstance(name, str) and ":" in name:
                raise
            raise KeyError(name) from e

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __contains__(self, name: object) -> bool:
        try:
            self.entry(name)   # type: ignore[arg-type]
        except PluginError:
            return False
        return True

    def __repr__(self) -> str:
        return f"<{self.kind} registry ({self.group}): {', '.join(self.names())}>"


@contextmanager
def blame(entry: Entry, error: type[Exception], passthrough: tuple[type[BaseException], ...] = ()):
    """Around a call of a plugin's object: an exception it raises (but `passthrough`'s) becomes `error`, one line
    naming the plugin and where it comes from (chained: --debug shows the plugin's traceback). Built-ins' errors
    pass unchanged."""
    if entry.origin == "built-in":
        yield
        return
    try:
        yield
    except passthrough:
        raise
    except Exception as e:
        raise error(f"{entry.kind} {entry.name!r} ({entry.origin}) raised {type(e).__name__}: {_first_line(e)}: "
                    f"fix the plugin (--debug shows its traceback)") from e


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


class Names(Sequence):
    """A registry's names as a config field's `choices` (coordinator/config.py): iterating lists them (for
    `--help` and the messages), found lazily from "module:attr" of the registry, so a config module need not
    import the registry's (torch-heavy) module. `in` accepts every string: the name is resolved, with a message
    that says what to fix, where the config is validated (`Registry.entry`)."""

    def __init__(self, where: str):
        self.where = where

    @property
    def registry(self) -> Registry:
        module, _, attr = self.where.partition(":")
        return getattr(sys.modules.get(module) or importlib.import_module(module), attr)

    def __iter__(self) -> Iterator[str]:
        return iter(self.registry.names())

    def __len__(self) -> int:
        return len(self.registry.names())

    def __getitem__(self, i):
        return self.registry.names()[i]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str)

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"Names({self.where!r})"
