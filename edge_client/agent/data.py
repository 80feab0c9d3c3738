"""The agent's data: its binding to the federation and its own shard.

`binding_of` is the agent's data binding (edge_client/federation.py) from its [data] and [model]
sections; `load_shard` computes its training shard and test split from dataset + partition + seed
exactly as the simulation does.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from edge_client import datasets, federation, partition
from edge_client.agent.config import AgentConfig, AgentError


def binding_of(cfg: AgentConfig, ds: datasets.Dataset | None = None) -> federation.DataBinding:
    """This agent's data binding (edge_client/federation.py): its [data] and [model] sections."""
    sections = {"data": cfg.data, "model": cfg.model, "run": cfg.data}  # the agent keeps the seed under [data]
    return federation.from_sections(sections, federation.label_digest(ds) if ds is not None else "")


@functools.lru_cache(maxsize=2)
def _federation(binding: federation.DataBinding, data_dir: str | None):
    """Dataset, train partition and test partition (cached: several agents may share a process)."""
    ds = datasets.load(binding.dataset, data_dir)
    return ds, federation.client_shards(ds, binding), federation.test_shards(ds, binding)


def load_shard(cfg: AgentConfig) -> tuple[datasets.Dataset, torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
    """(dataset, x, y of this client's training shard, x, y of its test split as numpy)."""
    try:
        ds, parts, test_parts = _federation(binding_of(cfg), cfg.data.data_dir)
    except (datasets.DatasetError, partition.PartitionError) as e:
        raise AgentError(str(e)) from None
    idx, tidx = torch.as_tensor(parts[cfg.agent.client]), torch.as_tensor(test_parts[cfg.agent.client])
    return ds, ds.train.x[idx], ds.train.y[idx], ds.test.x[tidx].numpy(), ds.test.y[tidx].numpy()
