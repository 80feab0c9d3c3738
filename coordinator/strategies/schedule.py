"""The local learning-rate schedules of the seed papers' runs, one pure function (`lr_at`).

The round loop sends lr_t with every task (`LoopConfig.lr_at`), and a strategy that applies the current lr
on the server (FedLaAvg and MIFA with lr-normalised storage) is bound to the same function, so both always
agree (`server_lr`).

    exp    lr_t = max(lr·γ^t, lr_min)            (γ < 1; γ = 1: lr_t = lr)   MimiC released code (γ = 0.95)
    inv-t  lr_t = max(lr/(t + 1), lr_min)                                     MIFA released code
    step   lr_t = max(lr·γ^⌊t/k⌋, lr_min)        (γ < 1; γ = 1: lr_t = lr)   step decay every k rounds

t is the 0-based round. `exp` is `step` with k = 1. Floor: `lr_min` (1e-5 by default, the MimiC code's;
`--lr-min 0` removes it).
"""

from __future__ import annotations

from collections.abc import Callable

SCHEDULES = ("exp", "inv-t", "step")


def lr_at(t: int, lr: float, *, schedule: str = "exp", decay: float = 1.0, lr_min: float = 1e-5,
          step_every: int = 1) -> float:
    """The local learning rate of round t (0-based) under `schedule` (module docstring)."""
    if schedule == "exp":
        return max(lr * decay ** t, lr_min) if decay < 1 else lr  # MimiC code: max(0.01·0.95^t, 1e-5)
    if schedule == "inv-t":
        return max(lr / (t + 1), lr_min)  # MIFA code: lr_0/(t + 1)
    if schedule == "step":
        if step_every < 1:
            raise ValueError(f"step_every must be >= 1 (got {step_every})")
        return max(lr * decay ** (t // step_every), lr_min) if decay < 1 else lr  # lr·γ^⌊t/k⌋
    raise ValueError(f"unknown lr schedule {schedule!r} (choose from {', '.join(SCHEDULES)})")


class LrNormalisedTable:
    """What FedLaAvg and MIFA share when their latest-update table may hold lr-normalised updates (d_i/η_i,
    applied with `server_lr`): the storage names and their check, and the run's lr schedule, bound to the
    strategy by `runsetup.build_strategy` (`bind_lr_schedule`)."""

    STORAGES = ("raw", "lr-normalised")
    storage = "raw"
    lr_at: Callable[[int], float] | None = None

    def set_storage(self, storage: str, lr_at: Callable[[int], float] | None) -> None:
        if storage not in self.STORAGES:
            raise ValueError(f"storage must be one of {', '.join(self.STORAGES)} (got {storage!r})")
        self.storage, self.lr_at = storage, lr_at

    def bind_lr_schedule(self, lr_at: Callable[[int], float]) -> None:
        """The run's local lr schedule (the loop's `lr_at`): the lr applied to the average in "lr-normalised"."""
        self.lr_at = lr_at


def server_lr(state: dict, t: int, updates: dict, bound=None) -> float:
    """η_t that a table of lr-normalised updates (d_i/η_i) is applied with in round t: the bound schedule's
    (`bound(t)`, the loop's `lr_at`); without one, the lr this round's updates were trained with, else the
    last one used (kept in state["lr"], float64 [1], so a round without uploads and a resumed run agree)."""
    if bound is not None:
        lr = float(bound(t))
    elif updates:
        lr = float(next(iter(updates.values())).lr)
    else:
        lr = float(state["lr"][0])
    state["lr"][0] = lr
    return lr
