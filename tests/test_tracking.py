"""--track tensorboard / mlflow (coordinator/tracking.py): what the trackers hold is read back with the tools'
own readers and compared with metrics.jsonl and config.json, also across --resume."""

import json
import os

import numpy as np
import pytest
from fieldkit import needs_mosquitto

from coordinator import tracking
from coordinator.cli import build_parser, main
from coordinator.config import resolve

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")

TINY = ["--dataset", "fmnist", "--clients", "6", "--model", "logreg", "--steps", "2", "--batch-size", "8",
        "--lr", "0.05", "--availability", "static", "--p", "0.5", "--engine", "loop", "--no-progress"]


def _rows(run):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _expected(rows):
    """{key: {round: value}} of every numeric metric, as the trackers should hold them."""
    out = {}
    for r in rows:
        for k, v in tracking.scalars(r).items():
            out.setdefault(k, {})[r["round"]] = v
    return out


def _tensorboard(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    got = {}
    for tag in ea.Tags()["scalars"]:
        events = ea.Scalars(tag)
        steps = [e.step for e in events]
        assert len(steps) == len(set(steps)), f"{tag}: a step logged twice {sorted(steps)}"
        got[tag] = {e.step: e.value for e in events}
    return got, ea


def _mlflow(store, run_dir):
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    exp = client.get_experiment_by_name(tracking.EXPERIMENT)
    runs = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags[tracking.RUN_TAG] == str(run_dir)]
    assert len(runs) == 1, f"{len(runs)} active MLflow runs for {run_dir}"
    run = runs[0]
    got = {}
    for key in run.data.metrics:
        hist = client.get_metric_history(run.info.run_id, key)
        steps = [m.step for m in hist]
        assert len(steps) == len(set(steps)), f"{key}: a step logged twice {sorted(steps)}"
        got[key] = {m.step: m.value for m in hist}
    return got, run


def _check_same(run):
    """Both trackers hold exactly metrics.jsonl's numeric fields, and MLflow the config as params."""
    want = _expected(_rows(run))
    assert {"accuracy", "loss", "train_loss", "participants", "available", "uploads", "seconds"} <= set(want)
    tb, _ = _tensorboard(run / "tb")
    assert tb == {k: {t: float(np.float32(v)) for t, v in steps.items()} for k, steps in want.items()}
    ml, mlrun = _mlflow(run / "mlruns", run.resolve())
    assert ml == want
    return mlrun


def test_both_trackers_hold_the_metrics_and_config(tmp_path):
    run = tmp_path / "run"
    assert main(["sim", *TINY, "--rounds", "3", "--track", "tensorboard", "--track", "mlflow",
                 "--out", str(run)]) == 0
    mlrun = _check_same(run)
    config = json.loads((run / "config.json").read_text())
    assert mlrun.data.params == {k: str(v) for k, v in tracking.flat_config(config).items()}
    assert mlrun.info.status == "FINISHED" and mlrun.info.run_name == "run"
    _, ea = _tensorboard(run / "tb")
    text = ea.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"strategy.algo": "fedavg"' in text and '"run.rounds": 3' in text
    from tensorboard.plugins.hparams import plugin_data_pb2

    content = ea.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hp = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    assert hp["strategy.algo"].string_value == "fedavg" and hp["run.rounds"].number_value == 3


def test_resume_logs_every_round_once(tmp_path):
    run = tmp_path / "run"
    args = ["sim", *TINY, "--track", "tensorboard,mlflow", "--out", str(run)]
    assert main([*args, "--rounds", "3"]) == 0
    first = _check_same(run).info.run_id
    assert main([*args, "--rounds", "5", "--resume"]) == 0  # rounds 3, 4: the same MLflow run goes on
    assert _check_same(run).info.run_id == first
    # the last checkpoint lost: the resumed run computes round 4 again, which both trackers already hold
    os.replace(run / "checkpoint.prev.pt", run / "checkpoint.pt")
    assert main([*args, "--rounds", "6", "--resume"]) == 0
    again = _check_same(run)
    assert again.info.run_id != first and [r["round"] for r in _rows(run)] == list(range(6))


def test_tracking_turned_on_at_resume_gets_the_earlier_rounds(tmp_path):
    run = tmp_path / "run"
    assert main(["sim", *TINY, "--rounds", "2", "--out", str(run)]) == 0
    assert not (run / "tb").exists() and not (run / "mlruns").exists()
    assert main(["sim", *TINY, "--rounds", "4", "--out", str(run), "--resume", "--track", "mlflow",
                 "--track", "tensorboard"]) == 0
    _check_same(run)


def test_track_dir_shared_by_runs_and_overwrite(tmp_path):
    shared = tmp_path / "track"
    for name in ("a", "b"):
        assert main(["sim", *TINY, "--rounds", "2", "--track", "tensorboard,mlflow", "--track-dir", str(shared),
                     "--out", str(tmp_path / name)]) == 0
    for name in ("a", "b"):
        tb, _ = _tensorboard(shared / "tb" / name)
        ml, _ = _mlflow(shared / "mlruns", (tmp_path / name).resolve())
        assert tb["participants"] and ml == _expected(_rows(tmp_path / name))
    # another run directory of the same name would mix its events into b's: refused, nothing written
    other = tmp_path / "x" / "b"
    rc = main(["sim", *TINY, "--rounds", "2", "--track", "tensorboard", "--track-dir", str(shared),
               "--out", str(other)])
    assert rc == 2 and not other.exists()
    assert main(["sim", *TINY, "--rounds", "2", "--p", "0.9", "--track", "tensorboard", "--track-dir", str(shared),
                 "--out", str(tmp_path / "b"), "--overwrite"]) == 0
    tb, _ = _tensorboard(shared / "tb" / "b")  # the replaced run's events are purged
    want = _expected(_rows(tmp_path / "b"))
    assert tb == {k: {t: float(np.float32(v)) for t, v in s.items()} for k, s in want.items()}


def test_repeated_flag_is_the_comma_list():
    def track(*argv):
        args = build_parser().parse_args(["sim", *argv])
        return resolve(args, ["fedavg"]).run.track

    assert track("--track", "tensorboard", "--track", "mlflow") == "tensorboard,mlflow" == track(
        "--track", "tensorboard,mlflow")
    assert track() is None
    assert tracking.parse("none") == [] and tracking.parse("mlflow,tensorboard,mlflow") == ["mlflow", "tensorboard"]


def test_unknown_tracker_and_missing_package_are_one_line_errors(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert main(["sim", *TINY, "--rounds", "2", "--track", "wandb", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dropfl: error: run.track must be") and "wandb" in err and "\n" not in err
    assert not out.exists()
    monkeypatch.setitem(tracking.TRACKERS, "mlflow", "dropfl_no_such_module")
    assert main(["sim", *TINY, "--rounds", "2", "--track", "mlflow", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install 'dropfl[tracking]'" in err and "\n" not in err
    assert not out.exists()


def test_config_file_section(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[run]\nrounds = 2\ntrack = "tensorboard"\n')
    run = tmp_path / "run"
    assert main(["sim", *TINY, "--config", str(cfg), "--out", str(run)]) == 0
    tb, _ = _tensorboard(run / "tb")
    assert set(tb["participants"]) == {0, 1} and not (run / "mlruns").exists()


@pytest.mark.slow
@needs_mosquitto
def test_trial_tracks_through_its_coordinator_and_is_quiet(tmp_path):
    """A trial hands --track to its coordinator (through trial-config.json); --quiet leaves stderr empty."""
    import subprocess
    import sys

    run = tmp_path / "trial"
    p = subprocess.run([sys.executable, "-m", "coordinator.cli", "trial", "--agents", "2", "--rounds", "2",
                        "--model", "logreg", "--steps", "1", "--deadline", "20", "--track", "tensorboard,mlflow",
                        "--quiet", "--out", str(run)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stderr == "" and "run directory:" in p.stdout
    assert "upload_bytes" in _check_same(run).data.metrics  # field mode's own measurements are tracked too
