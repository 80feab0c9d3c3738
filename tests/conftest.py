import os

import pytest
import torch

# Under pytest-xdist (`make test-fast`: one worker per core) each worker keeps to one thread, so that the workers
# do not oversubscribe the cores; a serial run (`make test`) uses up to 2.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1)))

# Test tiers: every test gets exactly one of these markers, from its file (this table, the one place that says it).
#   unit    pure code: strategies, config, wire, traces, reports, the CLI's checks (the default tier)
#   engine  training engines and kernels: batched and generic engines, native kernels, equivalence, sweeps, Ray
#   field   anything that starts a broker, agents, a trial or network namespaces
#   device  the device side as installed on a board: other Pythons, the emulated Raspberry Pi, setup-device.sh, CUDA
# `make test-fast` runs unit and engine tests not marked slow; `make test` runs every tier (what CI runs).
TIERS = {
    "unit": ("test_field_closing", "test_field_round_faults"),   # the field's round-closing rule: no broker
    "device": ("test_emulated_pi", "test_device_pythons", "test_setup_device", "test_agent_device", "test_cuda",
               "test_provision_plugins"),
    "field": ("test_field_", "test_trial_", "test_broker_security", "test_netem", "test_agent_lean", "test_provision",
              "test_telemetry", "test_dashboard", "test_alloc", "test_replay_field_engine", "test_tracking",
              "test_batchnorm_field"),
    "engine": ("test_kernels", "test_batched_fastpath", "test_engine_", "test_evaluator", "test_absorb_exact",
               "test_replay_exact", "test_sweep", "test_ray", "test_functional_engine", "test_objectives",
               "test_flower_equivalence", "test_flower_app", "test_flower_docs", "test_examples", "test_tutorial",
               "test_batchnorm"),
}
# a test that needs a broker, root or a cluster is a field test wherever it lives
FIELD_MARKS = ("mosquitto", "root", "cluster")


def tier_of(item: pytest.Item) -> str:
    name = item.path.stem
    for tier, prefixes in TIERS.items():
        if name.startswith(prefixes):
            return tier
    if any(item.get_closest_marker(m) for m in FIELD_MARKS):
        return "field"
    return "unit"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(getattr(pytest.mark, tier_of(item)))


@pytest.fixture(scope="session")
def fmnist():
    from edge_client.datasets import load_fmnist
    return load_fmnist()
