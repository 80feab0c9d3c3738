"""`dropfl plugins`: what each registry holds (strategy, model, dataset, partitioner, availability model), and
where each name comes from: built-in, an entry point of an installed distribution (`dist==version`), or a name
registered by another module. Listing loads the installed entry points, so it runs their code (docs/extending.md)."""

from __future__ import annotations

from coordinator import config
from edge_client.registry import Names

# kind → the config field that names one (config.REGISTRIES), in the order of `dropfl sim --help`
KINDS = {"strategy": "strategy.algo", "model": "model.model", "dataset": "data.dataset",
         "partitioner": "data.partition", "availability": "availability.kind"}


def add_parser(sub) -> None:
    p = sub.add_parser("plugins", help="list the strategies, models, datasets, partitioners and availability models "
                                       "installed, and where each comes from",
                       description="List what each registry holds and where each name comes from: built-in, an "
                                   "entry point of an installed distribution (dist==version), or registered by a "
                                   "module. Any flag that takes one of these names also takes module:attr "
                                   "(docs/extending.md). Loading an entry point runs its code.")
    p.add_argument("kind", nargs="?", choices=list(KINDS), help="list only this kind")
    p.set_defaults(func=_cli)


def _cli(args) -> int:
    for kind, key in KINDS.items():
        if args.kind and args.kind != kind:
            continue
        registry = Names(config.REGISTRIES[key]).registry
        section, name = key.split(".")
        print(f"{kind} ({config.flag(config._field(section, name))}, {key}; entry points: {registry.group})")
        rows = registry.listing()
        width = max(len(n) for n, _ in rows)
        for n, origin in rows:
            print(f"  {n:<{width}}  {origin}")
    print("Each flag also takes a plugin as module:attr (e.g. --algo mypkg.strategies:FedAvgM); a plugin named on "
          "the command line or in a config file runs its code.")
    return 0
