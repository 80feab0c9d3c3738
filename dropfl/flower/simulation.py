"""Run a Flower app in Flower's simulation engine under a dropfl config: `run_app` (and `dropfl flower run`).

The app is a Flower app directory as `flwr new` writes one: a pyproject.toml with `[tool.flwr.app.components]`
(`serverapp`, `clientapp`) and `[tool.flwr.app.config]`. `run_app` checks everything first (the app's
pyproject, the dropfl config as `dropfl sim` checks it, its availability, a replayed trace, the output
directory), then starts Flower's simulation engine (Ray, on this machine: `127.0.0.1`, no dashboard, Flower's
telemetry off) with one SuperNode per dropfl client, and passes the app these run-config values on top of its
own:

    dropfl-config       the dropfl config, as JSON (dropfl/flower/federation.py reads it in the app's task.py)
    dropfl-out          the run directory (dropfl/flower/rundir.py `under_dropfl` writes it)
    dropfl-overwrite    true with overwrite
    num-server-rounds   run.rounds        lr           train.lr
    batch-size          train.batch_size  local-epochs train.epochs  algo  strategy.algo

(the app's `[tool.flwr.app.config]` must declare the first three, as Flower accepts only declared keys; the
others are passed where it declares them). It drives Flower 1.41's simulation runtime as
`flwr`'s own simulation process does (`flwr.simulation.run_simulation._run_simulation` with the app directory
and a Run carrying the override config). `flwr run` would submit the app as a FAB to a SuperLink, which for a
local simulation it starts as a detached process that outlives the command and which installs the FAB under
Flower's home directory (docs/flower.md: not tested here).
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

from coordinator.errors import RunFailure, UserError

REQUIRED = ("dropfl-config", "dropfl-out", "dropfl-overwrite")
FROM_CONFIG = {"num-server-rounds": ("run", "rounds"), "lr": ("train", "lr"), "batch-size": ("train", "batch_size"),
               "local-epochs": ("train", "epochs"), "algo": ("strategy", "algo")}


def app_components(app_dir: str | Path) -> tuple[str, str, dict]:
    """(serverapp, clientapp, default run config) of a Flower app directory; UserError if it is not one."""
    p = Path(app_dir) / "pyproject.toml"
    try:
        project = tomllib.loads(p.read_text())
    except OSError as e:
        raise UserError(f"{app_dir}: cannot read {p.name} ({e.strerror}); give a Flower app directory "
                        f"(the one with pyproject.toml)") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"{p}: not valid TOML ({e})") from None
    app = project.get("tool", {}).get("flwr", {}).get("app", {})
    comp = app.get("components", {})
    if not isinstance(comp, dict) or not comp.get("serverapp") or not comp.get("clientapp"):
        raise UserError(f"{p}: no [tool.flwr.app.components] serverapp and clientapp; a Flower app names them "
                        f"there (e.g. serverapp = \"app.server_app:app\")")
    return comp["serverapp"], comp["clientapp"], app.get("config", {})


def run_app(app_dir: str | Path, config, out: str | Path, *, overwrite: bool = False, num_cpus: int = 2):
    """Run the Flower app in `app_dir` under the dropfl `config` (SimConfig, mapping or file), writing the dropfl
    run directory `out`; returns it as a `dropfl.RunDirectory`. Bad input raises UserError, nothing written."""
    import dropfl
    from coordinator.rundir import check_out, holds_run
    from coordinator.runsetup import build_availability

    app_dir = Path(app_dir).resolve()
    server_attr, client_attr, defaults = app_components(app_dir)
    missing = [k for k in REQUIRED if k not in defaults]
    if missing:
        raise UserError(f"{app_dir / 'pyproject.toml'}: [tool.flwr.app.config] lacks {', '.join(missing)}; a Flower "
                        f"app run by dropfl declares them (Flower accepts only declared keys; docs/flower.md)")
    cfg = dropfl.load_config(config)
    build_availability(cfg)                          # a bad trace or model setting: refused now
    if holds_run(Path(out)) and not overwrite:   # check_out would offer --resume, which a Flower run has not
        raise UserError(f"--out {out} already holds a run; add --overwrite to replace it (or choose another --out)")
    check_out(out, resume=False, overwrite=overwrite)
    if num_cpus < 1:
        raise UserError(f"--num-cpus {num_cpus}: give at least 1")
    override = {"dropfl-config": json.dumps(cfg.to_dict(), sort_keys=True),
                "dropfl-out": str(Path(out).resolve()), "dropfl-overwrite": bool(overwrite)}
    for key, (section, name) in FROM_CONFIG.items():
        if key in defaults:
            override[key] = getattr(getattr(cfg, section), name)
    _simulate(app_dir, server_attr, client_attr, override, cfg.data.clients, num_cpus)
    if not (Path(out) / "metrics.jsonl").exists():
        raise RunFailure(f"the Flower app in {app_dir} ran but wrote no run directory in {out}: its ServerApp must "
                         f"pass its strategy through dropfl.flower.under_dropfl(strategy, context) (docs/flower.md)")
    return dropfl.RunDirectory(out)


def _simulate(app_dir: Path, server_attr: str, client_attr: str, override: dict, supernodes: int,
              num_cpus: int) -> None:
    os.environ["FLWR_TELEMETRY_ENABLED"] = "0"        # only loopback is ever contacted
    from flwr.supercore import telemetry

    telemetry.FLWR_TELEMETRY_ENABLED = "0"            # read once when flwr was imported
    from flwr.app import Context, RecordDict
    from flwr.common.config import get_fused_config_from_dir
    from flwr.common.constant import RUN_ID_NUM_BYTES, SUPERLINK_NODE_ID, TASK_ID_NUM_BYTES
    from flwr.server.superlink.linkstate.utils import generate_rand_int_from_bytes
    from flwr.simulation.run_simulation import _run_simulation
    from flwr.supercore.constant import NOOP_FEDERATION_ID
    from flwr.supercore.run import Run
    from flwr.supercore.task_identity import TaskIdentity
    from flwr.supercore.telemetry import EventType

    run = Run.create_empty(run_id=generate_rand_int_from_bytes(RUN_ID_NUM_BYTES))
    run.primary_task_id = generate_rand_int_from_bytes(TASK_ID_NUM_BYTES)
    run.federation_id = NOOP_FEDERATION_ID
    run.override_config = override
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, run.run_id, SUPERLINK_NODE_ID
    context = Context(run_id=run.run_id, node_id=0, node_config={}, state=RecordDict(),
                      run_config=get_fused_config_from_dir(app_dir, override))
    backend = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
               # address "local": a Ray of its own, never a cluster another process of this machine started
               "init_args": {"address": "local", "num_cpus": num_cpus, "num_gpus": 0, "include_dashboard": False,
                             "_node_ip_address": "127.0.0.1"}}
    import ray

    ours = not ray.is_initialized()   # Flower starts Ray unless it runs already; only a Ray it started is stopped
    from ray._private import ray_constants

    before = os.environ.get(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR), ray_constants.ENABLE_RAY_CLUSTER
    # Flower's Ray backend sets this process's PYTHONPATH to its whole sys.path (for Ray's workers) and leaves it:
    # every later subprocess would then import from this venv (a device venv made by setup-device.sh included)
    pythonpath = os.environ.get("PYTHONPATH")
    if ours:   # every Ray process on 127.0.0.1 (as tests/test_ray.py's cluster): the processes Ray starts read the
        os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"   # variable, this one read it at `import ray`
        ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        _run_simulation(num_supernodes=supernodes, exit_event=EventType.PYTHON_API_RUN_SIMULATION_LEAVE,
                        server_app_attr=server_attr, client_app_attr=client_attr, app_dir=str(app_dir), run=run,
                        server_app_context=context, backend_config=backend, is_app=True)
    except UserError:
        raise
    except Exception as e:   # the ServerApp's own exception, re-raised by Flower's runtime
        if isinstance(e.__cause__, UserError):
            raise e.__cause__ from None
        raise RunFailure(f"the Flower simulation of {app_dir} failed: {type(e).__name__}: {e}") from e
    finally:
        if pythonpath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = pythonpath
        if ours and ray.is_initialized():
            ray.shutdown()
        if ours:   # as it was for whatever this process runs next
            ray_constants.ENABLE_RAY_CLUSTER = before[1]
            if before[0] is None:
                os.environ.pop(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, None)
            else:
                os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = before[0]
