"""The agent's data: its binding to the federation and its own shard.

`binding_of` is the agent's data binding (edge_client/federation.py) from its [data] and [model]
sections; `load_shard` computes its training shard and test split from dataset + partition + seed
exactly as the simulation does, reading only what it needs: the labels (the partition and the data
digest need nothing else), then only its own rows' images (`datasets.load_rows`; equal, bitwise, to the
same rows of the simulation's full load). A Raspberry Pi holds ~2,000 training images, not 60,000.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from edge_client import datasets, federation, partition
from edge_client.agent.config import AgentConfig, AgentError


def binding_of(cfg: AgentConfig, ds: datasets.Dataset | datasets.Labels | None = None) -> federation.DataBinding:
    """This agent's data binding (edge_client/federation.py): its [data] and [model] sections."""
    sections = {"data": cfg.data, "model": cfg.model, "run": cfg.data}  # the agent keeps the seed under [data]
    if isinstance(ds, datasets.Labels):
        return federation.from_sections(sections, federation.label_digest(ds))
    return federation.from_sections(sections, federation.label_digest(ds) if ds is not None else "")


@functools.lru_cache(maxsize=2)
def _federation(binding: federation.DataBinding, data_dir: str | None):
    """Labels, train partition and test partition (cached: several agents may share a process)."""
    labels = datasets.load_labels(binding.dataset, data_dir)
    return labels, federation.client_shards(labels, binding), federation.test_shards(labels, binding)


def load_shard(cfg: AgentConfig) -> tuple[datasets.Labels, torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
    """(the dataset's labels, x, y of this client's training shard, x, y of its test split as numpy)."""
    try:
        labels, parts, test_parts = _federation(binding_of(cfg), cfg.data.data_dir)
        train = datasets.load_rows(labels, "train", parts[cfg.agent.client])
        test = datasets.load_rows(labels, "test", test_parts[cfg.agent.client])
    except (datasets.DatasetError, partition.PartitionError) as e:
        raise AgentError(str(e)) from None
    return labels, train.x, train.y, test.x.numpy(), test.y.numpy()
