"""Seeded non-IID partitioners from the papers. Each returns a list of index arrays, one per client.

- `shards`           MimiC: sort by label, cut into shards (60 × 1000 on FMNIST), 2 random shards per client.
- `shards_distinct`  the same shards, but no client gets two shards of one class (MimiC's code: two distinct
                     classes per client).
- `fdms_clustered`   FL-FDMS: clusters of consecutive clients, disjoint label pairs per cluster,
                     `per_label` samples of each of the cluster's labels per client, without replacement.
                     `fdms-clustered-80-20`: the same, and each client trains on 80 % of each of its labels (the
                     FL-FDMS code's 80/20 per-client split: 160 of 200 MNIST samples).
- `fdms_general`     FL-FDMS general: sort by label, 200 partitions of 250, 2 per client (a `shards` setting).
- `one_label`        FedLaAvg: N/10 clients per digit, each digit's images split with proportions
                     5 + N(0, 1) clamped to [3, 7] and normalised (roughly Normal sizes).
- `dirichlet`        per class, proportions ~ Dir(alpha) over clients.
- `iid`              uniform random equal split.
- `natural`          the dataset's own clients: each writer (a LEAF user) is one client, no draw; `--clients` must
                     equal the number of writers.
"""

from __future__ import annotations

import numpy as np

from edge_client.registry import PluginError, Registry, blame


class PartitionError(ValueError):
    pass


def iid(labels: np.ndarray, n_clients: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(labels))
    return [np.sort(p) for p in np.array_split(perm, n_clients)]


def _shard_table(labels: np.ndarray, n_clients: int, shards_per_client: int, n_shards: int | None,
                 shard_size: int | None) -> np.ndarray:
    """[n_shards, shard_size] sample indices: the label-sorted (stable) list cut into consecutive shards.
    Defaults: n_shards = clients × shards_per_client, shard_size = n // n_shards."""
    n_shards = n_clients * shards_per_client if n_shards is None else n_shards
    shard_size = len(labels) // n_shards if shard_size is None else shard_size
    if n_clients * shards_per_client > n_shards:
        raise PartitionError(f"--clients: {n_clients} clients × {shards_per_client} shards exceed {n_shards} shards")
    if shard_size < 1 or shard_size * n_shards > len(labels):
        raise PartitionError(f"--partition: {n_shards} shards of {shard_size} do not fit {len(labels)} samples")
    return np.argsort(labels, kind="stable")[: n_shards * shard_size].reshape(n_shards, shard_size)


def shards(labels: np.ndarray, n_clients: int, seed: int, shards_per_client: int = 2,
           n_shards: int | None = None, shard_size: int | None = None) -> list[np.ndarray]:
    """Pathological shards (McMahan et al.; MimiC §7.1): sort indices by label (stable), cut the list
    into `n_shards` consecutive shards of `shard_size`, give each client `shards_per_client` distinct
    random shards. Defaults: n_shards = clients × shards_per_client, shard_size = n // n_shards
    (FMNIST, 30 clients: 60 single-class shards of 1000)."""
    order = _shard_table(labels, n_clients, shards_per_client, n_shards, shard_size)
    n_shards = len(order)
    rng = np.random.default_rng(seed)
    pick = rng.permutation(n_shards)
    return [np.sort(order[pick[c * shards_per_client:(c + 1) * shards_per_client]].ravel())
            for c in range(n_clients)]


def shards_distinct(labels: np.ndarray, n_clients: int, seed: int, shards_per_client: int = 2,
                    n_shards: int | None = None, shard_size: int | None = None,
                    tries: int = 1000) -> list[np.ndarray]:
    """`shards` (same shards, same defaults) with no two shards of one class on a client. A shard's class is
    its majority label (ties: the lower label); with whole-class shards (FMNIST: 60 × 1000) it is its only one.

    Deterministic by seed. The draw: random permutations, as `shards`, until one gives every client
    `shards_per_client` distinct classes (at most `tries`): this is the uniform distribution over the valid
    assignments (FMNIST, 30 clients × 2: about 1 permutation in 14 is valid). If none is found, a direct
    construction that always succeeds when any assignment exists: shards taken in random order (skipping a
    class once it has N shards), grouped by class in a random class order, and dealt round-robin to a random
    order of the clients (position p goes to client p mod N; a class has at most N consecutive positions)."""
    order = _shard_table(labels, n_clients, shards_per_client, n_shards, shard_size)
    n_shards = len(order)
    rng = np.random.default_rng(seed)
    shard_class = np.array([np.bincount(labels[s]).argmax() for s in order])  # majority label of each shard
    need = n_clients * shards_per_client
    for _ in range(tries):
        pick = rng.permutation(n_shards)[:need].reshape(n_clients, shards_per_client)
        cls = np.sort(shard_class[pick], axis=1)
        if shards_per_client == 1 or (cls[:, 1:] != cls[:, :-1]).all():
            return [np.sort(order[row].ravel()) for row in pick]
    # direct construction: at most n_clients shards of any class, grouped by class, dealt round-robin
    taken, count = [], {}
    for s in rng.permutation(n_shards):
        c = int(shard_class[s])
        if count.get(c, 0) < n_clients and len(taken) < need:
            taken.append(s)
            count[c] = count.get(c, 0) + 1
    if len(taken) < need:
        raise PartitionError(f"--partition shards-distinct: {len(count)} classes cannot give {n_clients} clients "
                             f"{shards_per_client} shards of distinct classes each")
    rank = {c: r for r, c in enumerate(rng.permutation(sorted(count)))}
    taken.sort(key=lambda s: rank[int(shard_class[s])])  # stable: the random order within a class stays
    clients = rng.permutation(n_clients)
    mine: list[list[int]] = [[] for _ in range(n_clients)]
    for pos, s in enumerate(taken):
        mine[clients[pos % n_clients]].append(s)
    return [np.sort(order[m].ravel()) for m in mine]


def fdms_general(labels: np.ndarray, n_clients: int, seed: int) -> list[np.ndarray]:
    """FL-FDMS general setting: label-sorted list cut into 200 partitions of 250, 2 per client."""
    return shards(labels, n_clients, seed, shards_per_client=2, n_shards=200, shard_size=250)


def fdms_clustered(labels: np.ndarray, n_clients: int, seed: int, n_clusters: int = 5,
                   labels_per_cluster: int = 2, per_label: int = 100,
                   train_fraction: float = 1.0) -> list[np.ndarray]:
    """FL-FDMS clustered setting: clients {0..3} form cluster 0, {4..7} cluster 1, ...; clusters get
    disjoint label sets drawn without replacement; each client takes `per_label` samples of each of its
    cluster's labels, without replacement across clients (MNIST: 2 × 100 = 200 samples per client).

    `train_fraction` < 1: each client keeps only the first int(train_fraction · per_label) of its (randomly
    drawn) samples of each label to train on; the rest are drawn all the same (the other clients get the
    same samples as with 1.0) and left unused. The FL-FDMS code trains on the first 80 % of each client's
    samples and holds out 20 % (fdms.md §4.2, 80/10/10, the 20 % unused for the reported metric); per label,
    so every client trains on 80 + 80 MNIST samples (`fdms-clustered-80-20`)."""
    if not 0 < train_fraction <= 1:
        raise PartitionError(f"--partition fdms-clustered: train fraction must be in (0, 1] (got {train_fraction})")
    keep = max(1, int(train_fraction * per_label))
    classes = np.unique(labels)
    if n_clusters * labels_per_cluster > len(classes):
        raise PartitionError(f"--partition fdms-clustered: {n_clusters} clusters × {labels_per_cluster} "
                             f"labels need more than {len(classes)} classes")
    if n_clients % n_clusters:
        raise PartitionError(f"--clients: {n_clients} is not a multiple of {n_clusters} clusters")
    rng = np.random.default_rng(seed)
    drawn = rng.permutation(classes)[: n_clusters * labels_per_cluster].reshape(n_clusters, labels_per_cluster)
    pools = {int(c): list(rng.permutation(np.flatnonzero(labels == c))) for c in classes}
    size = n_clients // n_clusters
    out = []
    for c in range(n_clients):
        mine = []
        for lab in drawn[c // size]:
            pool = pools[int(lab)]
            if len(pool) < per_label:
                raise PartitionError(f"--partition fdms-clustered: not enough samples of label {lab}")
            mine.extend(pool[:keep])  # the first `keep` of this client's per_label samples (all when 1.0)
            del pool[:per_label]
        out.append(np.sort(np.array(mine)))
    return out


def cluster_of(client: int, n_clients: int, n_clusters: int = 5) -> int:
    return client // (n_clients // n_clusters)


def one_label(labels: np.ndarray, n_clients: int, seed: int) -> list[np.ndarray]:
    """FedLaAvg: clients hold one digit each, N/10 clients per digit, ordered by digit (clients
    0..N/10-1 hold digit 0). Sizes follow proportions 5 + N(0,1) clamped to [3, 7] (FedLaAvg [C])."""
    classes = np.unique(labels)
    if n_clients % len(classes):
        raise PartitionError(f"--clients: {n_clients} is not a multiple of {len(classes)} classes")
    rng = np.random.default_rng(seed)
    per = n_clients // len(classes)
    out = []
    for c in classes:
        idx = rng.permutation(np.flatnonzero(labels == c))
        prop = np.clip(5 + rng.standard_normal(per), 3, 7)
        cuts = (np.cumsum(prop / prop.sum())[:-1] * len(idx)).astype(int)
        out.extend(np.sort(p) for p in np.split(idx, cuts))
    return out


def dirichlet(labels: np.ndarray, n_clients: int, seed: int, alpha: float = 0.5,
              min_size: int = 1) -> list[np.ndarray]:
    """Per class, split its samples over clients with proportions ~ Dir(alpha); redraw until every
    client has at least `min_size` samples (as in NIID-Bench)."""
    if alpha <= 0:
        raise PartitionError(f"--dirichlet-alpha must be > 0 (got {alpha})")
    rng = np.random.default_rng(seed)
    for _ in range(1000):
        buckets: list[list[int]] = [[] for _ in range(n_clients)]
        for c in np.unique(labels):
            idx = rng.permutation(np.flatnonzero(labels == c))
            cuts = (np.cumsum(rng.dirichlet(np.full(n_clients, alpha)))[:-1] * len(idx)).astype(int)
            for b, part in zip(buckets, np.split(idx, cuts)):
                b.extend(part.tolist())
        if min(len(b) for b in buckets) >= min_size:
            return [np.sort(np.array(b, dtype=np.int64)) for b in buckets]
    raise PartitionError(f"--dirichlet-alpha {alpha}: could not give every client {min_size} samples")


def fdms_clustered_80_20(labels: np.ndarray, n_clients: int, seed: int) -> list[np.ndarray]:
    """`fdms_clustered` with the FL-FDMS code's per-client 80/20 train/held-out split (train_fraction 0.8)."""
    return fdms_clustered(labels, n_clients, seed, train_fraction=0.8)


def natural(labels: np.ndarray, n_clients: int, seed: int, owners: np.ndarray | None = None) -> list[np.ndarray]:
    """The dataset's own per-writer partition (LEAF: one user, one client): client c holds the rows whose owner is c,
    in row order. `owners` comes from the dataset (`Split.owner`, a map-style split's `owners`); rows owned by -1
    are no client's. The seed is not used: there is nothing to draw."""
    if owners is None:
        raise PartitionError("--partition natural: this dataset has no writers of its own (leaf has; a plugin's "
                             "splits may give owners): choose another --partition")
    owners = np.asarray(owners, dtype=np.int64)
    if len(owners) != len(labels):
        raise PartitionError(f"--partition natural: {len(owners)} owners for {len(labels)} rows")
    n_users = int(owners.max()) + 1 if owners.size else 0
    if n_clients != n_users:
        raise PartitionError(f"--clients {n_clients}: the dataset has {n_users} writers and --partition natural "
                             f"makes each one a client: pass --clients {n_users}")
    out = [np.flatnonzero(owners == c) for c in range(n_users)]
    empty = [c for c, rows in enumerate(out) if not len(rows)]
    if empty:
        raise PartitionError(f"--partition natural: writer {empty[0]} has no rows")
    return out


def _is_partitioner(obj) -> str | None:
    return None if callable(obj) else "a callable (labels, n_clients, seed, **options) -> list of index arrays"


# The partitioners by --partition name (edge_client/registry.py): called as f(labels, n_clients, seed, **options),
# returning each client's sample indices (options: edge_client/federation.py partition_kwargs, none for a plugin);
# a plugin (entry point group dropfl.partitioners, or module:attr) is the same. Its fact:
#   uses_owners  it is called with owners= (each training row's writer, None where the dataset has none), and the
#                test split is shared out by the test rows' owners too (edge_client/federation.py)
PARTITIONERS = Registry("partitioner", "dropfl.partitioners", check=_is_partitioner, meta={"uses_owners": False})
for _name, _f in {"iid": iid, "shards": shards, "shards-distinct": shards_distinct, "fdms-clustered": fdms_clustered,
                  "fdms-clustered-80-20": fdms_clustered_80_20, "fdms-general": fdms_general, "one-label": one_label,
                  "dirichlet": dirichlet}.items():
    PARTITIONERS.register(_name, _f)
PARTITIONERS.register("natural", natural, uses_owners=True)


def partition(name: str, labels: np.ndarray, n_clients: int, seed: int, **kw) -> list[np.ndarray]:
    try:
        entry = PARTITIONERS.entry(name)
    except PluginError as e:
        raise PartitionError(f"--partition: {e}") from None
    if n_clients < 1:
        raise PartitionError(f"--clients must be >= 1 (got {n_clients})")
    with blame(entry, PartitionError, (PartitionError,)):
        return entry.obj(np.asarray(labels), n_clients, seed, **kw)
