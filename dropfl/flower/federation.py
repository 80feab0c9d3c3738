"""A dropfl federation for a Flower app's `task.py`: the data partition and the model of a dropfl config.

A Flower app that loads its clients' data and builds its model from here trains the same federation as
`dropfl sim` with the same config (dataset, partition, clients, seed, model): client i's training samples are
dropfl's client i's (edge_client/federation.py `client_shards`), the test set is dropfl's, and `model()` is the
config's model initialised from the config's seed, as `dropfl sim` initialises its global model.

    fed = federation(context.run_config["dropfl-config"])
    x, y = fed.shard(context.node_config["partition-id"])
    net = fed.model()

Each process loads a config's dataset once (`federation` keeps the last few).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch


def config_of(value):
    """A run-config value that names a dropfl config: the JSON text of one (what `dropfl flower run` passes), or
    the path of a TOML/JSON config file."""
    text = str(value).strip()
    if text.startswith("{"):
        return json.loads(text)
    return Path(text)


@dataclass
class Federation:
    cfg: object                                   # the checked SimConfig
    shards: list[tuple[torch.Tensor, torch.Tensor]]
    test: tuple[torch.Tensor, torch.Tensor]
    input_shape: tuple[int, ...]
    num_classes: int

    def shard(self, partition_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Client `partition_id`'s training samples (x, y), dropfl's client of that index."""
        return self.shards[int(partition_id)]

    def model(self) -> torch.nn.Module:
        """The config's model, initialised as `dropfl sim` initialises the global model (seeded by `run.seed`)."""
        from edge_client.models import build_model

        c = self.cfg
        return build_model(c.model.model, self.input_shape, self.num_classes, c.run.seed, c.model.dropout)

    def loop(self):
        """The config's round-loop settings (coordinator.loop.LoopConfig), e.g. for DropflStrategy."""
        from coordinator.runsetup import loop_config

        return loop_config(self.cfg)


@functools.lru_cache(maxsize=4)
def _load(key: str) -> Federation:
    import dropfl
    from coordinator.runsetup import binding_of, client_data, load_dataset

    cfg = dropfl.load_config(config_of(key))
    ds = load_dataset(cfg)
    return Federation(cfg, client_data(ds, binding_of(cfg, ds)), (ds.test.x, ds.test.y),
                      tuple(ds.train.x.shape[1:]), ds.num_classes)


def federation(config) -> Federation:
    """The federation of a dropfl config (JSON text, a config file's path, or a mapping of sections)."""
    if isinstance(config, dict):
        config = json.dumps(config, sort_keys=True)
    return _load(str(config))
