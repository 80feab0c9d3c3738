"""`dropfl plugins`: what each registry holds (strategy, model, dataset, partitioner, availability model, local
objective), and where each name comes from: built-in, an entry point of an installed distribution (`dist==version`),
or a name registered by another module; under a plugin that declares an Options dataclass, its options with their
types and defaults. `dropfl plugins KIND NAME` shows one, `module:attr` included. Listing loads the installed entry
points, so it runs their code (docs/extending.md)."""

from __future__ import annotations

from coordinator import config
from coordinator.errors import UserError
from edge_client import options as po
from edge_client.registry import Names, PluginError

# kind → the config field that names one (config.REGISTRIES), in the order of `dropfl sim --help`
KINDS = {"strategy": "strategy.algo", "model": "model.model", "dataset": "data.dataset",
         "partitioner": "data.partition", "availability": "availability.kind"}
# kind → the flag that sets a plugin's options (config.OPTIONS)
OPTION_FLAGS = {"strategy": "--strategy-option", "availability": "--availability-option"}


# kinds no flag names: a strategy attaches them to its clients' tasks (docs/objectives.md)
UNFLAGGED = {"objective": ("edge_client.objectives", "OBJECTIVES")}


def registry_of(kind: str):
    if kind in UNFLAGGED:
        import importlib
        module, attr = UNFLAGGED[kind]
        return getattr(importlib.import_module(module), attr)
    return Names(config.REGISTRIES[KINDS[kind]]).registry


def add_parser(sub) -> None:
    p = sub.add_parser("plugins", help="list the strategies, models, datasets, partitioners, availability models and "
                                       "local objectives installed, where each comes from, and their options",
                       description="List what each registry holds and where each name comes from: built-in, an "
                                   "entry point of an installed distribution (dist==version), or registered by a "
                                   "module; under a strategy or availability model that declares an Options "
                                   "dataclass, its options (--strategy-option / --availability-option KEY=VALUE) "
                                   "with their types and defaults. Any flag that takes one of these names also "
                                   "takes module:attr (docs/extending.md). Loading an entry point runs its code.")
    p.add_argument("kind", nargs="?", choices=[*KINDS, *UNFLAGGED], help="list only this kind")
    p.add_argument("name", nargs="?", help="show only this one (a name or module:attr) and its options")
    p.set_defaults(func=_cli)


def option_lines(kind: str, obj: object) -> list[str]:
    """The options `obj` declares, one line each (`--strategy-option name=TYPE  (default ...): help`); a line
    saying what is wrong with an Options class that cannot be used."""
    if kind not in OPTION_FLAGS:
        return []
    try:
        cls = po.options_class(obj)
    except po.OptionsError as e:
        return [f"options: error: {e}"]
    if cls is None:
        return []
    return [f"{OPTION_FLAGS[kind]} {s.name}={s.type_text() if s.choices else s.base.__name__.upper()}"
            f"{'|none' if s.optional and not s.choices else ''}  "
            f"({'required' if s.required else 'default ' + po.text(s.default)})" + (f": {s.help}" if s.help else "")
            for s in po.specs(cls)]


def _cli(args) -> int:
    if args.name is not None:
        return _one(args.kind, args.name)
    for kind in [*KINDS, *UNFLAGGED]:
        if args.kind and args.kind != kind:
            continue
        registry = registry_of(kind)
        if kind in KINDS:
            section, name = KINDS[kind].split(".")
            print(f"{kind} ({config.flag(config._field(section, name))}, {KINDS[kind]}; "
                  f"entry points: {registry.group})")
        else:
            print(f"local {kind} (attached to tasks by a strategy; entry points: {registry.group})")
        rows = registry.listing()
        width = max(len(n) for n, _ in rows)
        for n, origin in rows:
            print(f"  {n:<{width}}  {origin}")
            if kind in OPTION_FLAGS and not origin.startswith("error:") and "shadowed by" not in origin:
                for line in option_lines(kind, registry.entry(n).obj):
                    print(f"    {line}")
    print("Each flag also takes a plugin as module:attr (e.g. --algo mypkg.strategies:FedAvgM); a plugin named on "
          "the command line or in a config file runs its code.")
    return 0


def _one(kind: str | None, name: str) -> int:
    if kind is None:
        raise UserError(f"dropfl plugins {name}: give the kind first, e.g. dropfl plugins strategy {name}")
    registry = registry_of(kind)
    try:
        entry = registry.entry(name)
    except PluginError as e:
        raise UserError(f"dropfl plugins {kind} {name}: {e.reason}") from None
    print(f"{kind} {name}: {entry.origin}")
    lines = option_lines(kind, entry.obj)
    for line in lines:
        print(f"  {line}")
    if kind in OPTION_FLAGS and not lines:
        print("  no options" + (" of its own (its settings are `dropfl sim` flags)" if entry.origin == "built-in"
                                else " (it declares no Options dataclass)"))
    return 0
