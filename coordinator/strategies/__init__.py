"""Strategies, one module per algorithm. `STRATEGIES` maps the CLI name to the class."""

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

STRATEGIES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (FedAvg, Full, FedProx, Scaffold, MIFA, MimiC, MimiCClient, FedLaAvg, FDMS, Stale)}

__all__ = ["STRATEGIES", "ClientUpdate", "Strategy", "FedAvg", "Full", "FedProx", "Scaffold", "MIFA", "MimiC",
           "MimiCClient", "FedLaAvg", "FDMS", "Stale"]

STRATEGIES.update({cls.name: cls for cls in (FedDD, FedCS)})
__all__ += ["FedDD", "FedCS"]
