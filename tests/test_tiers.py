"""The test tiers (tests/conftest.py): every test file has its own entry in exactly one tier, so a new file cannot
land in `make test-fast` (unit and engine, not slow) or out of it by accident; and no file of the fast tiers names
what starts agent processes, Ray, a RabbitMQ cluster or network namespaces."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import DEFAULT_TIER, TIERS, tier_of

TESTS = Path(__file__).resolve().parent
FAST = ("unit", "engine")
# what starts a field tier's processes (a test marked mosquitto, root or cluster is a field test wherever it lives):
# agent and coordinator processes (tests/fieldkit.py), Ray (a local cluster, Flower's simulation engine through
# `dropfl flower run` or run_simulation), a RabbitMQ cluster (tests/rabbit.py), network namespaces
STARTERS = (r"\bstart_agent\(", r"\bstart_coordinator\(", r"\bray\.init\(", r"\bcluster_utils\b",
            r"\brun_simulation\(", r'"flower", "run"', r"\bRabbitCluster\(", r"\bnetns\b")


def files_here() -> list[str]:
    return sorted(p.stem for p in TESTS.glob("test_*.py"))


def test_every_test_file_has_exactly_one_tier_entry():
    entries = [name for files in TIERS.values() for name in files]
    assert sorted(set(entries)) == sorted(entries), "a file is listed twice"
    missing = [name for name in files_here() if name not in entries]
    assert missing == [], f"add these files to TIERS in tests/conftest.py: {missing}"
    assert all(name.startswith("test_") for name in entries)
    assert DEFAULT_TIER not in FAST   # a file without an entry never runs in the edit loop unseen


def test_no_fast_tier_file_starts_a_broker_ray_or_namespaces():
    found = {name: [s for s in STARTERS if re.search(s, (TESTS / f"{name}.py").read_text())]
             for tier in FAST for name in TIERS[tier] if name != "test_tiers" and (TESTS / f"{name}.py").exists()}
    assert {name: s for name, s in found.items() if s} == {}


class _Item:
    def __init__(self, stem: str, marks: tuple[str, ...] = ()):
        self.path = TESTS / f"{stem}.py"
        self.marks = marks

    def get_closest_marker(self, name: str):
        return name if name in self.marks else None


@pytest.mark.parametrize("stem,marks,tier", [
    ("test_report", (), "unit"),
    ("test_kernels", (), "engine"),
    ("test_ray", (), "field"),
    ("test_flower_equivalence", (), "field"),
    ("test_report", ("mosquitto",), "field"),    # a broker test is a field test wherever it lives
    ("test_report", ("root",), "field"),
    ("test_emulated_pi", (), "device"),
    ("test_not_in_the_table", (), DEFAULT_TIER),
])
def test_tier_of_a_test(stem, marks, tier):
    assert tier_of(_Item(stem, marks)) == tier
