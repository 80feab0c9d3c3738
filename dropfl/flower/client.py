"""dropfl's client side as a Flower ClientApp: each task trained by dropfl's reference `local_train`
(edge_client/trainer.py), the same code, batch order and dropout masks as a dropfl simulation or device agent.

    app = client_app(cfg)        # cfg: a dropfl SimConfig (dataset, partition, model, seed)

The app answers `dropfl.flower.nodes.discover`'s query with its partition id, and trains the task that
`DropflStrategy` sends (`task_from_message`, its local objectives included: FedProx's, SCAFFOLD's, a plugin's
installed here) on its partition of the federation's data (`shard`: dropfl's
partitioner, as `dropfl sim` cuts it), replying with the trained model (ArrayRecord "arrays") and a MetricRecord
"metrics": num-examples, steps, lr, train_loss and compute-s (the measured training time).
"""

from __future__ import annotations

import json

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from coordinator.config import SimConfig
from dropfl.flower.nodes import partition_of, partition_reply
from dropfl.flower.strategy import ARRAYS, CONFIG, DECLINED_TASK, METRICS, OBJECTIVES, model_arrays, to_vector
from edge_client import objectives
from edge_client.models import build_model
from edge_client.registry import PluginError
from edge_client.trainer import TrainTask, evaluate, local_train


class TaskDeclined(RuntimeError):
    """A task this client cannot train as asked (a local objective not installed here). Flower's runtime answers
    the message with an error reply whose reason holds this message; DropflStrategy records "declined"."""


def task_from_message(msg: Message) -> TrainTask:
    """The dropfl TrainTask in a `DropflStrategy` training message (`strategy.task_record` writes it), its local
    objectives decoded with this process's registry (`edge_client.objectives.decode`: registered names and
    installed entry points; a module a message names is never imported). TaskDeclined names an objective that
    is not installed here."""
    c = msg.content.config_records[CONFIG]
    record = msg.content.array_records.get(OBJECTIVES)
    tensor = to_vector(record) if record is not None else None
    try:
        objs = objectives.decode(json.loads(str(c[OBJECTIVES])), tensor) if OBJECTIVES in c else ()
    except PluginError as e:
        raise TaskDeclined(f"{DECLINED_TASK}{e}") from None
    return TrainTask(client=int(c["partition-id"]), round=int(c["round"]), lr=float(c["lr"]),
                     batch_size=int(c["batch-size"]), epochs=int(c["epochs"]) if "epochs" in c else None,
                     steps=int(c["steps"]) if "steps" in c else None, objectives=objs, seed=int(c["seed"]),
                     dropout_rate=float(c["dropout-rate"]) if "dropout-rate" in c else None,
                     sparse_download=bool(c.get("sparse-download", False)))


_FEDERATIONS: dict[str, tuple] = {}   # config (as JSON) → (dataset, shards, model), per process


def _federation(cfg: SimConfig, key: str):
    """(dataset, every client's shard, a model) of a config, once per process (a Ray actor serves many nodes)."""
    if key not in _FEDERATIONS:
        from coordinator import runsetup

        ds = runsetup.load_dataset(cfg)
        shards = runsetup.client_data(ds, runsetup.binding_of(cfg, ds))
        model = build_model(cfg.model.model, tuple(ds.train.x.shape[1:]), ds.num_classes, cfg.run.seed,
                            cfg.model.dropout)
        _FEDERATIONS.clear()   # one federation at a time: a dataset is ~200 MB
        _FEDERATIONS[key] = ds, shards, model
    return _FEDERATIONS[key]


def client_app(cfg: SimConfig) -> ClientApp:
    """A ClientApp training dropfl's tasks on the partitions of `cfg`'s federation (partition id = client index)."""
    key = json.dumps(cfg.to_dict(), sort_keys=True)
    app = ClientApp()
    app.query()(partition_reply)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        _, shards, model = _federation(cfg, key)
        task = task_from_message(msg)
        if task.client != partition_of(context):
            raise ValueError(f"node {context.node_id} holds partition {partition_of(context)}, "
                             f"the task is for {task.client}")
        x, y = shards[task.client]
        r = local_train(model, to_vector(msg.content.array_records[ARRAYS]), x, y, task)
        metrics = MetricRecord({"num-examples": r.num_samples, "steps": r.steps, "lr": task.lr,
                                "train_loss": r.loss, "compute-s": r.seconds})
        return Message(RecordDict({ARRAYS: model_arrays(model), METRICS: metrics}), reply_to=msg)

    @app.evaluate()
    def evaluate_(msg: Message, context: Context) -> Message:
        ds, _, model = _federation(cfg, key)
        acc, loss = evaluate(model, to_vector(msg.content.array_records[ARRAYS]), ds.test.x, ds.test.y)
        metrics = MetricRecord({"num-examples": len(ds.test.y), "accuracy": acc, "loss": loss})
        return Message(RecordDict({METRICS: metrics}), reply_to=msg)

    return app

