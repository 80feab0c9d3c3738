"""FedDD over a real mosquitto: three agent processes on 127.0.0.1, two coordinator runs (FedAvg, then
FedDD, 2 rounds each, logreg). A separate MQTT subscriber counts the payload bytes on the update
topics: FedDD's sparse uploads are measurably smaller on the wire, the coordinator decoded and
aggregated them, and the strategy's rate estimates come from the agents' measured transfers."""

import json
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from fieldkit import CLI, ROOT, kill_group, start_agent
from paho.mqtt import client as mqtt

from coordinator.availability.participation import read_rows
from coordinator.field.collection import RoundState
from coordinator.field.connection import FieldConfig
from coordinator.field.hub import FieldHub
from coordinator.field.sparse import update_tensors
from coordinator.rundir import read_metrics
from coordinator.trial.broker import Mosquitto
from edge_client import feddd, wire
from edge_client.federation import DataBinding
from edge_client.models import build_model
from edge_client.trainer import TrainTask

N = 3
SEED = 3


class ByteCounter:
    """Sums the MQTT payload sizes on dropfl/v1/device/+/update/delta per (run id, round)."""

    def __init__(self, port: int):
        self.cond = threading.Condition()
        self.bytes: dict[tuple[str, int], int] = {}
        self.messages: dict[str, int] = {}
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="test-byte-counter")
        self.c.on_connect = lambda c, *a: c.subscribe("dropfl/v1/device/+/update/delta", qos=1)
        self.c.on_message = self._on_message
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()

    def _on_message(self, client, userdata, msg) -> None:
        h, _ = wire.decode_frame(msg.payload)
        with self.cond:
            key = (h.run, h.round)
            self.bytes[key] = self.bytes.get(key, 0) + len(msg.payload)
            if h.chunk == h.chunks - 1:
                self.messages[h.run] = self.messages.get(h.run, 0) + 1
            self.cond.notify_all()

    def wait_messages(self, run: str, n: int, timeout: float = 30.0) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.messages.get(run, 0) >= n, timeout=timeout)

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def write_agent_config(i: int, broker: str, out: Path) -> Path:
    cfg = {"agent": {"client": i, "broker": broker, "heartbeat_s": 0.3, "out": str(out / f"client-{i}"),
                     "exit_when_done": False},
           "data": {"dataset": "fmnist", "partition": "iid", "clients": N, "seed": SEED},
           "model": {"model": "logreg"}, "battery": {"source": "mains"}}
    path = out / f"client-{i}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg))
    return path


def run_coordinator(broker: str, out: Path, algo: str, run_id: str) -> None:
    cmd = CLI + ["coordinator", "--broker", broker, "--out", str(out), "--rounds", "2", "--algo", algo,
                 "--clients", str(N), "--model", "logreg", "--partition", "iid", "--seed", str(SEED),
                 "--steps", "3", "--lr", "0.05", "--threads", "1", "--deadline", "30", "--heartbeat-timeout", "10",
                 "--run-id", run_id, "--no-progress"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.fixture(scope="module")
def trials(tmp_path_factory):
    d = tmp_path_factory.mktemp("feddd-field")
    broker = Mosquitto(workdir=d / "broker")
    counter = ByteCounter(broker.port)
    agents = [start_agent(write_agent_config(i, broker.url, d / "agents"), d / "agents" / f"client-{i}.log")
              for i in range(N)]
    try:
        for algo in ("fedavg", "feddd"):
            run_coordinator(broker.url, d / algo, algo, f"test-{algo}")
            counter.wait_messages(f"test-{algo}", 2 * N)
        yield d, counter
    finally:
        for p in agents:
            kill_group(p)
        counter.close()
        broker.close()


def test_feddd_uploads_are_smaller_on_the_wire(trials):
    d, counter = trials
    for algo in ("fedavg", "feddd"):
        rows = read_rows(d / algo / "participation.csv")
        assert [r["status"] for r in rows] == ["participated"] * (2 * N), algo
    avg0, avg1 = counter.bytes[("test-fedavg", 0)], counter.bytes[("test-fedavg", 1)]
    dd0, dd1 = counter.bytes[("test-feddd", 0)], counter.bytes[("test-feddd", 1)]
    dense = feddd.dense_nbytes(feddd.unit_layout(build_model("logreg", (1, 28, 28), 10, SEED)))
    # three dense float32 updates plus their frames' headers: an update travels in chunks of at least 4 KiB
    # (edge_client/agent/work.py: the first upload in first_chunk_bytes, later ones sized to the measured
    # uplink), each with a header of well under 1 kB
    for avg in (avg0, avg1):
        assert N * dense < avg < N * (dense + (-(-dense // 4096) + 1) * 1000)
    # round 0: D = 0 for everyone (Algorithm 1), the sparse payload carries all values plus its bitmap
    # (every value travels: more than the dense bytes, and not more than 5 % over FedAvg's frames)
    assert N * dense < dd0 < 1.05 * avg0
    # round 1: the allocation's A_server = 0.6 budget, i.e. ~60 % of the values (+ headers) travel
    assert dd1 < 0.75 * avg1
    assert dd0 + dd1 < 0.9 * (avg0 + avg1)
    # the metrics count the same tensors the agents sent (upload_bytes = tensor body bytes)
    metrics = read_metrics(d / "feddd" / "metrics.jsonl")
    assert 0 < metrics[1]["upload_bytes"] < dd1 and metrics[1]["upload_bytes_total"] < dd0 + dd1


def test_feddd_strategy_consumed_measured_rates_and_sparse_updates(trials):
    d, _ = trials
    state = torch.load(d / "feddd" / "checkpoint.pt")["state"]
    for key in ("compute_s", "up_Bps", "down_Bps"):  # smoothed from the agents' real transfers and training
        assert torch.isfinite(state[key]).all() and (state[key] > 0).all(), key
    assert torch.isfinite(state["label_score"]).all() and (state["label_score"] >= 1).all()
    # next round's allocation, from those measurements: the budget holds (mean D = 1 − A_server)
    assert abs(float(state["dropout"].mean()) - 0.4) < 1e-4
    assert (state["dropout"] >= -1e-9).all() and (state["dropout"] <= 0.8 + 1e-9).all()
    log = [json.loads(line) for line in open(d / "feddd" / "field.jsonl")]
    rounds = [e for e in log if e["event"] == "round"]
    assert [e["rejected"] for e in rounds] == [0, 0] and all(e["participants"] == N for e in rounds)


# --- the coordinator's checks, without a broker (messages fed to FieldHub as paho delivers them) ---

BINDING = DataBinding(dataset="fmnist", partition="iid", clients=4, shards_per_client=2, dirichlet_alpha=0.5,
                      seed=0, model="logreg", dropout=None).to_meta()


def sparse_hub(tmp_path) -> tuple[FieldHub, feddd.Layout]:
    layout = feddd.unit_layout(build_model("logreg", (1, 28, 28), 10, 0))
    hub = FieldHub(FieldConfig(run_id="run-x", heartbeat_timeout_s=60), 4, DataBinding(**BINDING), layout.numel,
                   tmp_path)
    hub.collection.layout = layout  # what MqttTransport sets
    for c in range(4):
        hub._dispatch(f"d{c}", "status", wire.encode("status", "", -1, c, meta={"state": "online"} | BINDING)[0],
                      False)
    return hub, layout


def send_sparse(hub: FieldHub, c: int, payload: bytes, rate: float = 0.5) -> None:
    body = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    meta = {"num_samples": 10, "steps": 2, "encoding": feddd.WIRE_ENCODING, "dropout_rate": rate}
    for f in wire.encode("update", "run-x", 0, c, body, meta):
        hub._dispatch(f"d{c}", "update/delta", f, False)


def test_hub_decodes_a_valid_sparse_update_and_rejects_broken_ones(tmp_path):
    hub, layout = sparse_hub(tmp_path)
    tasks = {c: TrainTask(client=c, round=0, lr=0.1, batch_size=4, dropout_rate=0.5) for c in range(3)}
    tasks[3] = TrainTask(client=3, round=0, lr=0.1, batch_size=4)  # a FedAvg task: no masks allowed
    r = hub.collection.round = RoundState(0, tasks, 0.0)
    w = torch.linspace(-1, 1, layout.numel)
    w_local = w + 0.25
    masks = [np.array([True, False] * 5)]  # logreg: one layer of 10 neurons, keep 5
    payload = feddd.encode_sparse(layout, masks, w_local)
    send_sparse(hub, 0, payload)
    send_sparse(hub, 1, payload[:-4])                                     # count disagrees with the length
    bad = feddd.encode_sparse(layout, masks, torch.where(w > 0.5, float("nan"), w_local))
    send_sparse(hub, 2, bad)                                              # NaN among the kept values
    send_sparse(hub, 3, payload)                                          # sparse answer to a FedAvg task
    assert list(r.updates) == [0] and r.dropped == {1: "rejected", 2: "rejected", 3: "rejected"}
    delta, mask = update_tensors(layout, r.updates[0], w)
    assert torch.equal(mask, feddd.flat_mask(layout, masks)) and int(mask.sum()) == 5 * 785
    assert torch.allclose(delta[mask], torch.full((5 * 785,), -0.25), atol=1e-6) and (delta[~mask] == 0).all()
