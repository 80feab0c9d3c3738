"""Small helpers the example strategies share (public API only)."""

from __future__ import annotations

from dataclasses import fields

import dropfl
import torch

ROW_BLOCK = 1024   # rows of a per-client table summed at a time (both state stores read slices)


def check_fraction(name: str, value: float, *, low_open: bool = False) -> None:
    """ValueError unless `value` is a number in [0, 1] ((0, 1] with low_open)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number (got {value!r})")
    if not (0 < value <= 1 if low_open else 0 <= value <= 1):
        raise ValueError(f"{name} must be in {'(0, 1]' if low_open else '[0, 1]'} (got {value})")


def check_choice(name: str, value: object, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(str, choices))} (got {value!r})")


def check_positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number > 0 (got {value!r})")


def options_or_defaults(cls: type, options: object | None):
    """`options` if it is a `cls.Options`, the defaults for None; TypeError otherwise."""
    if options is None:
        return cls.Options()
    if not isinstance(options, cls.Options):
        raise TypeError(f"{cls.__name__}: options must be a {cls.__name__}.Options (got {type(options).__name__})")
    return options


def describe(options: object) -> str:
    return ", ".join(f"{f.name}={getattr(options, f.name)!r}" for f in fields(options))


def mean_delta(updates: dict[int, dropfl.ClientUpdate], weighting: str = "uniform") -> torch.Tensor:
    """(1/|S|) Σ_{i∈S} Δ_i ("uniform", the papers' equal weights) or Σ n_i Δ_i / Σ n_i ("samples")."""
    ups = [updates[i] for i in sorted(updates)]
    if weighting == "samples":
        total = sum(u.num_samples for u in ups)
        return sum(u.delta * (u.num_samples / total) for u in ups)
    return torch.stack([u.delta for u in ups]).mean(0)


def table_sum(table) -> torch.Tensor:
    """Σ_j table[j] over all N rows of a per-client table (`Strategy.table`), in blocks of ROW_BLOCK rows."""
    n = table.shape[0]
    total = table[0:ROW_BLOCK].sum(0)
    for a in range(ROW_BLOCK, n, ROW_BLOCK):
        total = total + table[a:a + ROW_BLOCK].sum(0)
    return total
