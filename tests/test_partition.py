import numpy as np
import pytest

from edge_client import partition as P


def _labels(per_class=6000, classes=10):
    return np.repeat(np.arange(classes), per_class)


def _disjoint_cover(parts, n):
    allidx = np.concatenate(parts)
    assert len(np.unique(allidx)) == len(allidx), "a sample is given to two clients"
    assert allidx.max() < n


def test_shards_mimic_invariant():
    y = np.random.default_rng(1).permutation(_labels())
    parts = P.partition("shards", y, 30, seed=0)
    _disjoint_cover(parts, len(y))
    assert [len(p) for p in parts] == [2000] * 30
    for p in parts:  # two single-class shards of 1000 each
        counts = np.bincount(y[p], minlength=10)
        assert sorted(counts[counts > 0].tolist()) in ([1000, 1000], [2000])
    assert sum(len(p) for p in parts) == 60000
    # seeded: same seed same split, other seed other split
    assert all((a == b).all() for a, b in zip(parts, P.partition("shards", y, 30, seed=0)))
    assert any((a != b).any() for a, b in zip(parts, P.partition("shards", y, 30, seed=1)))


def test_fdms_general_200_shards_of_250():
    y = _labels(5000)  # CIFAR-sized
    parts = P.partition("fdms-general", y, 20, seed=0)
    _disjoint_cover(parts, len(y))
    assert [len(p) for p in parts] == [500] * 20
    for p in parts:
        assert len(np.unique(y[p])) <= 2


def test_fdms_clustered_labels_per_cluster():
    y = _labels()
    parts = P.partition("fdms-clustered", y, 20, seed=3)
    _disjoint_cover(parts, len(y))
    assert [len(p) for p in parts] == [200] * 20
    label_sets = [tuple(np.unique(y[p])) for p in parts]
    for c in range(5):
        members = label_sets[4 * c:4 * c + 4]
        assert len(set(members)) == 1 and len(members[0]) == 2  # same two labels within a cluster
        assert all(np.bincount(y[p], minlength=10)[list(members[0])].tolist() == [100, 100]
                   for p in parts[4 * c:4 * c + 4])
    assert len({lab for s in label_sets for lab in s}) == 10  # disjoint pairs cover all labels


def test_one_label_fedlaavg():
    y = _labels()
    parts = P.partition("one-label", y, 100, seed=0)
    _disjoint_cover(parts, len(y))
    assert sum(len(p) for p in parts) == 60000  # all images used
    for i, p in enumerate(parts):
        assert np.unique(y[p]).tolist() == [i // 10]  # ordered by digit, N/10 clients each
    sizes = np.array([len(p) for p in parts])
    assert sizes.min() >= 600 * 3 / 7 * 0.9 and sizes.max() <= 600 * 7 / 3 * 1.1
    assert sizes.std() > 0


def test_dirichlet_small_alpha_is_skewed():
    y = _labels(600)
    parts = P.partition("dirichlet", y, 10, seed=0, alpha=0.1)
    _disjoint_cover(parts, len(y))
    assert sum(len(p) for p in parts) == 6000
    dominant = [np.bincount(y[p], minlength=10).max() / len(p) for p in parts]
    assert np.mean(dominant) > 0.5
    with pytest.raises(P.PartitionError, match="alpha"):
        P.partition("dirichlet", y, 10, seed=0, alpha=0)


def test_unknown_partitioner():
    with pytest.raises(P.PartitionError, match="--partition"):
        P.partition("bogus", _labels(10), 2, 0)
