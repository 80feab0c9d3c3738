"""A tiny plugin distribution made in a test's directory: package `tinyplug` with a model builder, installed as a
distribution would be (its dist-info with a `dropfl.models` entry point), in a version of the test's choice."""

from __future__ import annotations

import sys
from pathlib import Path

DIST, PACKAGE, MODEL = "tinyplug", "tinyplug", "tinyplug-mlp"

SOURCE = '''"""A plugin model for the tests: an MLP of {hidden} hidden units."""

from torch import nn


def build(input_shape, num_classes, dropout=None):
    n = 1
    for d in input_shape:
        n *= d
    return nn.Sequential(nn.Flatten(), nn.Linear(n, {hidden}), nn.ReLU(), nn.Linear({hidden}, num_classes))
'''


def make_plugin(root: Path, version: str = "1.0", hidden: int = 16) -> Path:
    """`root` (created) holding the package and its dist-info; put it on sys.path (or PYTHONPATH) to install it."""
    pkg = root / PACKAGE
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(SOURCE.format(hidden=hidden))
    info = root / f"{DIST}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text(f"[dropfl.models]\n{MODEL} = {PACKAGE}:build\n")
    (info / "top_level.txt").write_text(f"{PACKAGE}\n")
    return root


def forget() -> None:
    """Drop the package from sys.modules (a test that moves sys.path between versions)."""
    sys.modules.pop(PACKAGE, None)
