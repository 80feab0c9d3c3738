"""Strategies, one module per algorithm. `STRATEGIES` maps the CLI name to the class."""

from coordinator.strategies.base import ClientUpdate, Strategy
from coordinator.strategies.fedavg import FedAvg, Full

STRATEGIES: dict[str, type[Strategy]] = {cls.name: cls for cls in (FedAvg, Full)}

__all__ = ["STRATEGIES", "ClientUpdate", "Strategy", "FedAvg", "Full"]
