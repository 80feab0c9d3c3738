"""The interfaces of the round loop (coordinator/loop.py), written down: what a strategy, a transport and an
availability source must have, and the optional features the loop uses where they are there.

Each interface is a `typing.Protocol`: the required part first (`Strategy`, `Transport`, `AvailabilitySource`),
then one small protocol per optional feature, so a checker (or `isinstance`, they are runtime-checkable) can say
which features an object has. The loop used to find them with `hasattr`/`getattr`; the helpers at the end answer
the same questions with the same results (`streams(transport)`, `round_log_file(strategy)`, ...), for the loop
to switch to.

Strategies subclass `coordinator.strategies.base.Strategy`, which has the whole required part with defaults; the
protocol below is what the loop and `runsetup.setup_run` rely on. Transports and availability sources need no
base class.

State set after construction (by `runsetup.setup_run` / `build_strategy`, before the round loop starts):
    strategy.store             the run's StateStore (RAM or the run directory) for the per-client tables
    strategy.bind_lr_schedule  called with the run's `lr_at` (LrScheduled, optional)
A strategy must not use `store` in its constructor; `init_state` and later may.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np
    import torch

    from coordinator.availability.models import RoundAvailability
    from coordinator.statestore import StateStore
    from coordinator.strategies.base import ClientUpdate
    from edge_client.report import ClientReport
    from edge_client.trainer import TrainTask

State = dict[str, Any]   # a strategy's state: flat dict of tensors (and per-client tables), checkpointed


# --- strategies ------------------------------------------------------------------------------------------------

@runtime_checkable
class Strategy(Protocol):
    """Required. Pure tensor math: no sockets, files or clocks (ARCHITECTURE principle 2)."""

    name: str                   # the registry / `--algo` name, and the prefix of its state-store tables
    uploads_per_round: int      # vectors each participant uploads per round (metrics `uploads`; SCAFFOLD: 2)
    sets_dropout_rate: bool     # its tasks carry a dropout_rate (FedDD): the simulation trains them on the loop
    tables: tuple[str, ...]     # state entries that are per-client [N, M] tables, kept in `store`
    store: StateStore           # set after construction by setup_run (see the module docstring)
    absorbs: bool               # True: has `absorb` (see Absorbing); the loop may stream updates into it

    def init_state(self, n_clients: int, w0: torch.Tensor) -> State: ...

    def adopt_state(self, state: State) -> State:
        """A checkpoint's state with its tables moved into this run's store (--resume)."""
        ...

    def select(self, state: State, t: int, available: np.ndarray, rng: np.random.Generator) -> list[int]: ...

    def configure(self, state: State, t: int, task: TrainTask) -> TrainTask: ...

    def aggregate(self, state: State, t: int, w: torch.Tensor,
                  updates: dict[int, ClientUpdate]) -> tuple[torch.Tensor, State]: ...


@runtime_checkable
class Absorbing(Protocol):
    """Optional: takes each update into its state as it arrives (MIFA). Only where `absorbs` is True; the loop
    then asks a streaming transport (StreamingTransport) to call `absorb` per slice and drops each delta
    (u.delta = None), and `aggregate` gets the absorbed updates with delta None."""

    absorbs: bool

    def absorb(self, state: State, t: int, u: ClientUpdate) -> None: ...


@runtime_checkable
class RoundLogging(Protocol):
    """Optional: a per-round log of its own in the run directory (FL-FDMS: friends.jsonl). The loop writes
    `round_log(...)` after every aggregation into `round_log_file` (a JSON-lines file, cut back to the checkpoint
    on --resume like metrics.jsonl). A falsy `round_log_file` means no log."""

    round_log_file: str | None

    def round_log(self, state: State, t: int, updates: dict[int, ClientUpdate]) -> dict: ...


@runtime_checkable
class FromConfig(Protocol):
    """Optional (runsetup.build_strategy): built from the run's StrategyConfig; without it the class is called
    with `weighting=` only."""

    @classmethod
    def from_config(cls, s: Any) -> Any: ...


@runtime_checkable
class LrScheduled(Protocol):
    """Optional (runsetup.build_strategy, after construction): given the run's local lr schedule `lr_at(t)`
    (FedLaAvg, MIFA with lr-normalised storage apply the round's lr on the server)."""

    def bind_lr_schedule(self, lr_at: Callable[[int], float]) -> None: ...


# --- transports ------------------------------------------------------------------------------------------------

@runtime_checkable
class Transport(Protocol):
    """Required: broadcast the global model, run the tasks, return the updates that arrived in time and a drop
    reason for each task that did not (docs/traces.md's reasons)."""

    def run_round(self, t: int, w: torch.Tensor, tasks: list[TrainTask]
                  ) -> tuple[dict[int, ClientUpdate], dict[int, str]]: ...


@runtime_checkable
class StreamingTransport(Protocol):
    """Optional: with `streams_updates = True`, `run_round(..., absorb=f)` calls `f` with each batch of updates
    as it arrives (SimTransport). The loop uses it only for a strategy that absorbs (Absorbing)."""

    streams_updates: bool

    def run_round(self, t: int, w: torch.Tensor, tasks: list[TrainTask],
                  absorb: Callable[[dict[int, ClientUpdate]], None] | None = None
                  ) -> tuple[dict[int, ClientUpdate], dict[int, str]]: ...


@runtime_checkable
class BufferTransport(Protocol):
    """Optional: with `carries_buffers = True`, `run_round(..., buffers=b)` starts every client from the global
    buffers `b` (BatchNorm's running statistics) and returns each update with its client's buffers after training
    (`ClientUpdate.buffers`; coordinator/buffers.py). The loop passes `buffers=` only for a model that has buffers."""

    carries_buffers: bool


@runtime_checkable
class StatefulTransport(Protocol):
    """Optional: what the clients keep between rounds (the simulation's FedDD device memory). `state_dict()`
    goes into every checkpoint (key "transport"); `load_state_dict` gets it back on --resume (an older
    checkpoint without it: not called)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@runtime_checkable
class RoundStats(Protocol):
    """Optional: numbers the transport measured this round (bytes, virtual round time), asked after each
    round; each goes into the metrics row as `key` and, summed over the run, `key_total`."""

    def round_stats(self) -> dict[str, float]: ...


@runtime_checkable
class RoundInfo(Protocol):
    """Optional: facts about this round for the metrics row, not summed (SimTransport: the `engine` that ran)."""

    def round_info(self) -> dict[str, Any]: ...


@runtime_checkable
class Closable(Protocol):
    """Optional: release what the transport holds (worker processes) once the run ends (sim/run.py)."""

    def close(self) -> None: ...


# --- availability ----------------------------------------------------------------------------------------------

@runtime_checkable
class AvailabilitySource(Protocol):
    """Required: who can take part in round t, and why each other client cannot (`RoundAvailability`). Must
    answer any round in any order with the same result (resume, replay): draw randomness from (seed, t)."""

    def round(self, t: int) -> RoundAvailability: ...


@runtime_checkable
class RecordedRound(Protocol):
    """Optional, on a round's answer (a replayed participation log: `participation.LoggedRound`).
    `selected`: the recorded selection, trained and aggregated instead of the strategy's (None or absent: the
    strategy's). `drops`: {client: reason} dropped after selection; their updates are left out, and a client
    whose reason is a refusal (loop.DECLINED) is not trained. `reports`: {client: ClientReport} the recorded
    run measured, carried by the replay's updates instead of the transport's (None: not recorded); `tasks`:
    the task parameters the recorded strategy set ({client: {dropout_rate, sparse_download}})."""

    selected: list[int] | None
    drops: dict[int, str] | None
    reports: dict[int, ClientReport | None] | None
    tasks: dict[int, dict] | None


# --- the loop's questions, answered as its hasattr/getattr sites do -----------------------------------------------

def round_log_file(strategy: object) -> str | None:
    """The strategy's own per-round log file, or None (RoundLogging)."""
    return getattr(strategy, "round_log_file", None) or None


def streams(transport: object) -> bool:
    """Whether `run_round` takes `absorb=` (StreamingTransport)."""
    return bool(getattr(transport, "streams_updates", False))


def carries_buffers(transport: object) -> bool:
    """Whether `run_round` takes `buffers=` (BufferTransport)."""
    return bool(getattr(transport, "carries_buffers", False))


def recorded_selection(avail: object) -> list[int] | None:
    """A replayed round's recorded selection, or None (RecordedRound)."""
    return getattr(avail, "selected", None)


def recorded_drops(avail: object) -> dict[int, str] | None:
    """A replayed round's drops after selection, or None (RecordedRound)."""
    return getattr(avail, "drops", None)


def recorded_reports(avail: object) -> dict | None:
    """A replayed round's recorded measurements, or None (RecordedRound)."""
    return getattr(avail, "reports", None)


def round_info(transport: object) -> dict:
    """The transport's facts about the round, {} without RoundInfo."""
    return transport.round_info() if isinstance(transport, RoundInfo) else {}


def round_stats(transport: object) -> dict[str, float]:
    """The transport's measurements of the round, {} without RoundStats."""
    return transport.round_stats() if isinstance(transport, RoundStats) else {}


# every attribute the loop may probe for, by protocol (tests/test_api.py checks loop.py against it)
PROBED: dict[str, type] = {
    "round_log_file": RoundLogging, "round_log": RoundLogging, "absorb": Absorbing,
    "streams_updates": StreamingTransport, "carries_buffers": BufferTransport,
    "state_dict": StatefulTransport, "load_state_dict": StatefulTransport,
    "round_stats": RoundStats, "round_info": RoundInfo, "close": Closable,
    "selected": RecordedRound, "drops": RecordedRound, "reports": RecordedRound, "tasks": RecordedRound,
    "from_config": FromConfig, "bind_lr_schedule": LrScheduled,
}

__all__ = ["State", "Strategy", "Absorbing", "RoundLogging", "FromConfig", "LrScheduled", "Transport",
           "StreamingTransport", "StatefulTransport", "RoundStats", "RoundInfo", "Closable", "AvailabilitySource",
           "RecordedRound", "PROBED", "round_log_file", "streams", "recorded_selection", "recorded_drops",
           "recorded_reports", "round_info", "round_stats"]
