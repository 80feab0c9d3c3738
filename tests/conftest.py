import os

import pytest
import torch

# Under pytest-xdist (`make test-fast`: one worker per core) each worker keeps to one thread, so that the workers
# do not oversubscribe the cores; a serial run (`make test`) uses up to 2.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1)))

# Test tiers: every test gets exactly one of these markers, from its file (this table, the one place that says it;
# tests/test_tiers.py fails for a test file that is not in it).
#   unit    pure code: strategies, config, wire, traces, reports, the CLI's checks, sensors on a fake sysfs, the
#           coordinator's field side and the agent's pieces fed messages by hand (no broker)
#   engine  training engines and kernels: batched and generic engines, native kernels, equivalence, sweeps
#   field   anything that starts a broker, agents, a trial, network namespaces or Ray (a cluster, Flower's engine);
#           also the dashboard in a browser, the trackers
#           (tensorboard, mlflow) and the allocator's page faults counted in subprocesses
#   device  the device side as installed on a board: other Pythons, the emulated Raspberry Pi, setup-device.sh, CUDA
# `make test-fast` runs unit and engine tests not marked slow; `make test` runs every tier (what CI runs).
TIERS = {
    "unit": (
        "test_agent_lean", "test_api", "test_availability", "test_bench_workloads", "test_binding", "test_cli_fuzz",
        "test_config_types", "test_configfile", "test_cvx_allocation", "test_dataset_cache", "test_dataset_loaders",
        "test_datasets", "test_diverged", "test_edge_cases", "test_fdms_friends", "test_feddd_client",
        "test_feddd_server", "test_field_agent", "test_field_closing", "test_field_components", "test_field_hub",
        "test_field_round_faults", "test_field_validation", "test_field_wire", "test_flower_strategy", "test_models",
        "test_partition", "test_plugin_identity", "test_plugin_options", "test_progress", "test_reading",
        "test_registry", "test_replay_reports", "test_report", "test_reproduce", "test_safe_rundir", "test_sim",
        "test_state_store", "test_strategies_cli", "test_strategies_fdms", "test_strategies_fedlaavg",
        "test_strategies_fedprox_scaffold", "test_strategies_mifa_stale", "test_strategies_mimic",
        "test_strategy_variants", "test_telemetry", "test_tiers", "test_trace_validation", "test_traces",
        "test_trainer", "test_wire_fuzz",
    ),
    "engine": (
        "test_absorb_exact", "test_batched_fastpath", "test_batchnorm", "test_channels_last", "test_client_pooling",
        "test_engine_device",
        "test_engine_equivalence",
        "test_engine_workers", "test_evaluator", "test_examples", "test_flower_objectives", "test_functional_engine",
        "test_kernels", "test_objectives", "test_replay_exact", "test_sweep", "test_tutorial",
    ),
    "field": (
        "test_alloc", "test_batchnorm_field", "test_broker_security", "test_dashboard", "test_field_cluster",
        "test_field_e2e", "test_field_empty", "test_field_fault_suite", "test_field_faults", "test_field_feddd",
        "test_field_links", "test_field_outage", "test_field_plugins", "test_field_replay_all", "test_field_slow_link",
        "test_field_telemetry", "test_field_tls_rejects", "test_flower_app", "test_flower_docs",
        "test_flower_equivalence", "test_netem", "test_provision", "test_ray", "test_replay_field_engine",
        "test_tracking", "test_trial_cli", "test_trial_supervise", "test_trial_tls",
    ),
    "device": (
        "test_agent_device", "test_cuda", "test_device_pythons", "test_emulated_cpu", "test_emulated_pi",
        "test_provision_plugins", "test_setup_device",
    ),
}
# a test that needs a broker, root or a cluster is a field test wherever it lives
FIELD_MARKS = ("mosquitto", "root", "cluster")
# a file missing from TIERS (tests/test_tiers.py says which) stays out of `make test-fast` until it has its entry
DEFAULT_TIER = "field"


def tier_of(item: pytest.Item) -> str:
    if any(item.get_closest_marker(m) for m in FIELD_MARKS):
        return "field"
    name = item.path.stem
    return next((tier for tier, files in TIERS.items() if name in files), DEFAULT_TIER)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(getattr(pytest.mark, tier_of(item)))


@pytest.fixture(scope="session")
def fmnist():
    from edge_client.datasets import load_fmnist
    return load_fmnist()
