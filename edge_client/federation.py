"""What makes a federation one experiment: its data binding, and the client shards it implies.

The **data binding** is everything an edge agent must share with the coordinator so that its shard,
its model and its training are the ones the simulation (and a replay) would use. It is declared once,
here, as `DataBinding`; the coordinator builds it from its `SimConfig` (`BINDING_SOURCE` names the
config field of each binding key, `coordinator/runsetup.py`), an agent from its config file's `[data]`
and `[model]` sections, and the coordinator refuses an agent whose binding differs, naming the fields
(`diff`). `data_digest` binds the data itself (a digest of the training labels, and of the rows' writers and
the class names where a dataset has them: `label_digest`), not the path it was read from: two hosts keep their
datasets in different directories.

`client_shards` is the one place that turns a binding into per-client index arrays; simulation and
agents both call it. Lives on the device side because the agent may not import `coordinator`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

import numpy as np

from edge_client import datasets, partition


@dataclass(frozen=True)
class DataBinding:
    dataset: str
    partition: str
    clients: int
    shards_per_client: int
    dirichlet_alpha: float
    seed: int
    model: str
    dropout: float | None
    data_digest: str = ""      # digest of the training labels (`label_digest`); "" = not computed

    def to_meta(self) -> dict:
        return dataclasses.asdict(self)


# Where each binding key comes from in the coordinator's config (section, field). A test enumerates every
# SimConfig field: each is here or in coordinator/runsetup.py's NOT_BOUND with the reason.
BINDING_SOURCE: dict[str, tuple[str, str]] = {
    "dataset": ("data", "dataset"),
    "partition": ("data", "partition"),
    "clients": ("data", "clients"),
    "shards_per_client": ("data", "shards_per_client"),
    "dirichlet_alpha": ("data", "dirichlet_alpha"),
    "seed": ("run", "seed"),
    "model": ("model", "model"),
    "dropout": ("model", "dropout"),
}


def from_sections(sections: dict[str, object], data_digest: str = "") -> DataBinding:
    """The binding from config sections (objects with attributes), e.g. {"data": cfg.data, "run": cfg.run}."""
    return DataBinding(**{k: getattr(sections[s], f) for k, (s, f) in BINDING_SOURCE.items()},
                       data_digest=data_digest)


def diff(mine: DataBinding, theirs: dict) -> dict[str, tuple]:
    """{key: (theirs, mine)} for every binding key whose value differs (a missing key differs)."""
    out = {}
    for k, v in dataclasses.asdict(mine).items():
        if k == "data_digest" and (not v or not theirs.get(k)):
            continue  # one side did not compute it (older agent): the other keys still bind
        if theirs.get(k) != v:
            out[k] = (theirs.get(k), v)
    return out


def _parts(ds) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, tuple[str, ...] | None]:
    """(training labels, training rows' owners, test rows' owners, class names) of a Dataset, Labels or labels."""
    if isinstance(ds, np.ndarray):
        return ds, None, None, None
    if isinstance(ds, datasets.Labels):
        return ds.train_y, ds.train_owner, ds.test_owner, ds.classes
    own = [None if s.owner is None else s.owner.numpy() for s in (ds.train, ds.test)]
    return ds.train.y.numpy(), own[0], own[1], ds.classes


def label_digest(ds: datasets.Dataset | datasets.Labels | np.ndarray) -> str:
    """16 hex digits of SHA-256 over the training labels (a dataset, its labels, or its training labels as numpy),
    and, where the dataset has them, its rows' owners (train, then test: the natural partition) and its class
    names: the same data wherever it was read from. A dataset without owners or class names (fmnist, mnist,
    cifar10, npz) digests its training labels alone, as before owners existed. Pixels are not digested."""
    y, train_owner, test_owner, classes = _parts(ds)
    h = hashlib.sha256(np.ascontiguousarray(y.astype(np.int64)).tobytes())
    if train_owner is not None or test_owner is not None:
        for tag, o in ((b"owners/train", train_owner), (b"owners/test", test_owner)):
            h.update(tag)
            if o is not None:
                h.update(np.ascontiguousarray(np.asarray(o, dtype=np.int64)).tobytes())
    if classes is not None:
        h.update(b"classes")
        h.update(json.dumps(list(classes)).encode())
    return h.hexdigest()[:16]


def partition_kwargs(b: DataBinding) -> dict:
    """The partitioner's own options among the binding's."""
    if b.partition in ("shards", "shards-distinct"):
        return {"shards_per_client": b.shards_per_client}
    if b.partition == "dirichlet":
        return {"alpha": b.dirichlet_alpha}
    return {}


def client_shards(ds: datasets.Dataset | datasets.Labels | np.ndarray, b: DataBinding) -> list[np.ndarray]:
    """Each client's training indices (raises partition.PartitionError on impossible settings). Needs only
    the training labels (and owners, for a partitioner that uses them): a dataset, its `Labels`, or its training
    labels as numpy (an agent reads no other image)."""
    y, owners, _, _ = _parts(ds)
    kw = partition_kwargs(b)
    if partition.PARTITIONERS.meta(b.partition, "uses_owners"):
        kw["owners"] = owners
    return partition.partition(b.partition, y, b.clients, b.seed, **kw)


def test_shards(ds: datasets.Dataset | datasets.Labels | np.ndarray, b: DataBinding) -> list[np.ndarray]:
    """Each client's share of the test split, for on-device evaluation: IID (a dataset, its `Labels`, or its test
    labels), or, for a partitioner that uses owners (--partition natural), each client's own test rows."""
    if isinstance(ds, np.ndarray):
        y, owners = ds, None
    elif isinstance(ds, datasets.Labels):
        y, owners = ds.test_y, ds.test_owner
    else:
        y, owners = ds.test.y.numpy(), None if ds.test.owner is None else ds.test.owner.numpy()
    if owners is not None and partition.PARTITIONERS.meta(b.partition, "uses_owners"):
        return [np.flatnonzero(owners == c) for c in range(b.clients)]
    return partition.iid(y, b.clients, b.seed)
