"""dropfl's public API: the names here are stable (docs/api.md); everything else is internal and may move.

    import dropfl

    if __name__ == "__main__":            # the batched engine's worker processes run this script again
        cfg = dropfl.SimConfig()
        cfg.data.clients, cfg.run.rounds = 4, 2
        run = dropfl.simulate(cfg, out="runs/api")
        print(run.final["accuracy"])

A thin layer over the packages `coordinator` (server side), `edge_client` (device side) and `cvx`: re-exports
with stable names, and entry points that check their input exactly as the `dropfl` commands do.
"""

from __future__ import annotations

from coordinator.availability.models import AVAILABILITY, REASONS, Availability, RoundAvailability
from coordinator.availability.participation import LoggedRound, Replay
from coordinator.config import (
    AvailabilityConfig,
    ClockConfig,
    DataConfig,
    ModelConfig,
    RunConfig,
    SimConfig,
    StrategyConfig,
    TrainConfig,
)
from coordinator.errors import RunFailure, UserError
from coordinator.field.connection import FieldConfig
from coordinator.protocols import (
    Absorbing,
    AvailabilitySource,
    Closable,
    FromConfig,
    LrScheduled,
    RecordedRound,
    RoundInfo,
    RoundLogging,
    RoundStats,
    StatefulTransport,
    StreamingTransport,
    Transport,
)
from coordinator.protocols import Strategy as StrategyProtocol
from coordinator.strategies import STRATEGIES
from coordinator.strategies.base import ClientUpdate, State, Strategy
from dropfl._guard import MainGuardError
from dropfl.api import RunDirectory, field, load_config, replay, simulate
from edge_client.datasets import DATASETS
from edge_client.datasets_files import load_image_folder
from edge_client.models import MODELS
from edge_client.objectives import OBJECTIVES, Correction, LocalObjective, Proximal, split_like
from edge_client.partition import PARTITIONERS
from edge_client.registry import PluginError, Registry
from edge_client.report import ClientReport
from edge_client.trainer import LocalResult, TrainTask

try:
    from importlib.metadata import PackageNotFoundError, version

    __version__ = version("dropfl")
except PackageNotFoundError:   # run from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    # entry points
    "simulate", "replay", "field", "load_config", "RunDirectory",
    # configuration (one dataclass per concern)
    "SimConfig", "DataConfig", "ModelConfig", "TrainConfig", "AvailabilityConfig", "StrategyConfig", "ClockConfig",
    "RunConfig", "FieldConfig",
    # errors
    "UserError", "RunFailure", "MainGuardError",
    # strategies and what they exchange
    "Strategy", "STRATEGIES", "State", "ClientUpdate", "ClientReport", "TrainTask", "LocalResult",
    # availability
    "Availability", "RoundAvailability", "REASONS", "Replay", "LoggedRound",
    # the registries (one per kind: built-ins, then entry points, then module:attr; docs/extending.md)
    "MODELS", "DATASETS", "PARTITIONERS", "AVAILABILITY", "OBJECTIVES", "Registry", "PluginError",
    # local objectives: what a client adds to its training (docs/objectives.md)
    "LocalObjective", "Proximal", "Correction", "split_like",
    # datasets on disk (docs/datasets.md)
    "load_image_folder",
    # the round loop's interfaces (coordinator/protocols.py)
    "StrategyProtocol", "Absorbing", "RoundLogging", "FromConfig", "LrScheduled", "Transport", "StreamingTransport",
    "StatefulTransport", "RoundStats", "RoundInfo", "Closable", "AvailabilitySource", "RecordedRound",
    "__version__",
]
