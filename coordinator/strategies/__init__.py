"""Strategies, one module per algorithm. `STRATEGIES` is the strategy registry (edge_client/registry.py): the
--algo name → the class. A built-in is its module plus one `STRATEGIES.register` line below; a plugin (entry
point group dropfl.strategies, or --algo module:attr) is a class of the same shape, usually a `Strategy` subclass."""

from coordinator.strategies.base import ClientUpdate, Strategy
from coordinator.strategies.fdms import FDMS
from coordinator.strategies.fedavg import FedAvg, Full
from coordinator.strategies.fedcs import FedCS
from coordinator.strategies.feddd import FedDD
from coordinator.strategies.fedlaavg import FedLaAvg
from coordinator.strategies.fedprox import FedProx
from coordinator.strategies.mifa import MIFA
from coordinator.strategies.mimic import MimiC, MimiCClient
from coordinator.strategies.scaffold import Scaffold
from coordinator.strategies.stale import Stale
from edge_client.registry import Registry

METHODS = ("init_state", "select", "configure", "aggregate")   # what the round loop calls (coordinator/protocols.py)


def _is_strategy(obj) -> str | None:
    if isinstance(obj, type) and all(callable(getattr(obj, m, None)) for m in METHODS):
        return None
    return f"a strategy class (a subclass of dropfl.Strategy, with {', '.join(METHODS)})"


STRATEGIES = Registry("strategy", "dropfl.strategies", check=_is_strategy)
STRATEGIES.register("fedavg", FedAvg)
STRATEGIES.register("full", Full)
STRATEGIES.register("fedprox", FedProx)
STRATEGIES.register("scaffold", Scaffold)
STRATEGIES.register("mifa", MIFA)
STRATEGIES.register("mimic", MimiC)
STRATEGIES.register("mimic-client", MimiCClient)
STRATEGIES.register("fedlaavg", FedLaAvg)
STRATEGIES.register("fdms", FDMS)
STRATEGIES.register("stale", Stale)
STRATEGIES.register("feddd", FedDD)
STRATEGIES.register("fedcs", FedCS)

__all__ = ["STRATEGIES", "ClientUpdate", "Strategy", "FedAvg", "Full", "FedProx", "Scaffold", "MIFA", "MimiC",
           "MimiCClient", "FedLaAvg", "FDMS", "Stale", "FedDD", "FedCS"]
