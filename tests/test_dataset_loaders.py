"""The loaders for data on disk (edge_client/datasets_files.py) and the dataset interface (edge_client/datasets.py):
each test writes its own small files (an .npz, a 2-class folder of 8x8 PNGs, a 3-user FEMNIST-style LEAF tree, a
Shakespeare-style one) and checks shapes, values (uint8 / 255 exactly), class order, the natural partition's
clients, the row readers (bitwise equal to the full load), the data digest, one-line errors through `dropfl sim`
and `dropfl.simulate` (nothing written), and a 2-round `dropfl sim` on each."""

from __future__ import annotations

import json
import sys
import textwrap

import numpy as np
import pytest
import torch
from PIL import Image

import dropfl
from coordinator import cli
from edge_client import datasets, federation
from edge_client.datasets_files import LEAF_LETTERS, _npz_rows
from edge_client.federation import DataBinding
from edge_client.partition import PartitionError

RNG = np.random.default_rng(7)


def _binding(dataset: str, part: str, clients: int) -> DataBinding:
    return DataBinding(dataset, part, clients, 2, 0.5, seed=3, model="logreg", dropout=None)


def _rows_equal_full(name: str, data_dir: str, rows: dict[str, np.ndarray]) -> datasets.Labels:
    """load_labels reads the labels without the full load; load_rows's rows equal the full load's, bitwise."""
    full = datasets.load(name, data_dir)
    labels = datasets.load_labels(name, data_dir)
    assert labels.full is None and labels.splits is not None          # a row reader, not the full load
    assert np.array_equal(labels.train_y, full.train.y.numpy()) and np.array_equal(labels.test_y, full.test.y.numpy())
    for split, r in rows.items():
        got, want = datasets.load_rows(labels, split, r), getattr(full, split)
        assert got.x.dtype == torch.float32 and got.x.shape == (len(r), *want.x.shape[1:])
        assert torch.equal(got.x, want.x[torch.from_numpy(r)]) and torch.equal(got.y, want.y[torch.from_numpy(r)])
    assert federation.label_digest(labels) == federation.label_digest(full)   # agent and coordinator agree
    return labels


# --- npz -------------------------------------------------------------------------------------------------------------

def _tiny_npz(path, x_train, x_test, y_train=None, y_test=None, compressed=False, **extra):
    y_train = np.arange(len(x_train)) % 3 if y_train is None else y_train
    y_test = np.arange(len(x_test)) % 3 if y_test is None else y_test
    (np.savez_compressed if compressed else np.savez)(path, x_train=x_train, y_train=y_train, x_test=x_test,
                                                      y_test=y_test, **extra)
    return str(path)


def test_npz_grayscale_uint8_is_scaled_exactly_and_gets_one_channel(tmp_path):
    x = RNG.integers(0, 256, (12, 8, 8), dtype=np.uint8)
    x[0, 0, :3] = [0, 51, 255]
    ds = datasets.load("npz", _tiny_npz(tmp_path / "d.npz", x, x[:6]))
    assert ds.train.x.shape == (12, 1, 8, 8) and ds.test.x.shape == (6, 1, 8, 8) and ds.train.x.dtype == torch.float32
    assert ds.train.x[0, 0, 0, :3].tolist() == [0.0, np.float32(0.2), 1.0]
    assert torch.equal(ds.train.x[:, 0], torch.from_numpy(x).to(torch.float32) / 255)
    assert ds.train.y.tolist() == [i % 3 for i in range(12)] and ds.train.y.dtype == torch.int64
    assert ds.num_classes == 3 and ds.train.owner is None


@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
def test_npz_colour_layouts_become_nchw(tmp_path, layout):
    nchw = RNG.integers(0, 256, (10, 3, 4, 5), dtype=np.uint8)
    x = nchw.transpose(0, 2, 3, 1) if layout == "nhwc" else nchw   # NHWC: [10, 4, 5, 3]
    ds = datasets.load("npz", _tiny_npz(tmp_path / "d.npz", x, x[:4]))
    assert ds.train.x.shape == (10, 3, 4, 5)
    assert torch.equal(ds.train.x, torch.from_numpy(nchw).to(torch.float32) / 255)


def test_npz_float_images_and_features_are_kept_as_they_are(tmp_path):
    x = RNG.random((9, 2, 2, 1))        # float64 NHWC, one channel
    ds = datasets.load("npz", _tiny_npz(tmp_path / "f.npz", x, x[:3]))
    assert ds.train.x.shape == (9, 1, 2, 2)
    assert torch.equal(ds.train.x[:, 0], torch.from_numpy(x[..., 0].astype(np.float32)))
    feats = RNG.random((9, 5)).astype(np.float32)
    ds = datasets.load("npz", _tiny_npz(tmp_path / "g.npz", feats, feats[:3]))
    assert ds.train.x.shape == (9, 5) and torch.equal(ds.train.x, torch.from_numpy(feats))


def test_npz_train_and_test_files_in_a_directory_and_a_num_classes_array(tmp_path):
    x = RNG.integers(0, 256, (6, 8, 8), dtype=np.uint8)
    np.savez(tmp_path / "train.npz", x=x, y=np.array([0, 1, 0, 1, 0, 1]), num_classes=np.array(5))
    np.savez(tmp_path / "test.npz", x_test=x[:2], y_test=np.array([4, 0]))
    ds = datasets.load("npz", str(tmp_path))
    assert ds.num_classes == 5 and ds.test.y.tolist() == [4, 0] and torch.equal(ds.test.x[:, 0], ds.train.x[:2, 0])
    assert datasets.source_files("npz", str(tmp_path)) == [tmp_path / "test.npz", tmp_path / "train.npz"]


@pytest.mark.parametrize("compressed", [False, True])
def test_npz_row_reader_streams_rows_bitwise_equal_to_the_full_load(tmp_path, compressed):
    x = RNG.integers(0, 256, (40, 8, 8, 3), dtype=np.uint8)
    path = _tiny_npz(tmp_path / "d.npz", x, x[:10], compressed=compressed)
    _rows_equal_full("npz", path, {"train": np.array([39, 0, 17, 17, 5]), "test": np.array([9, 1])})
    labels = datasets.load_labels("npz", path)
    assert datasets.load_rows(labels, "train", np.array([], dtype=np.int64)).x.shape == (0, 3, 8, 8)
    rows = np.array([31, 2, 30, 7])   # several blocks of 3 rows: the streamed path, not one read
    assert np.array_equal(_npz_rows(tmp_path / "d.npz", "x_train", rows, block_rows=3), x[rows])


# --- image folder ----------------------------------------------------------------------------------------------------

def _folder(root, classes=("cat", "ant"), per_class=(3, 2), mode="L", size=(8, 8)):
    """train/<class>/i.png and test/<class>/i.png: random pixels; returns {path: pixels}."""
    pixels = {}
    for split, n in zip(("train", "test"), per_class):
        for c in classes:
            d = root / split / c
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                a = RNG.integers(0, 256, (*size, 3) if mode == "RGB" else size, dtype=np.uint8)
                Image.fromarray(a, mode).save(d / f"{i}.png")
                pixels[d / f"{i}.png"] = a
    return pixels


def test_image_folder_classes_sorted_by_name_and_pixels_exact(tmp_path):
    pixels = _folder(tmp_path)
    ds = datasets.load("imagefolder", str(tmp_path))
    assert ds.classes == ("ant", "cat") and ds.num_classes == 2
    assert ds.train.x.shape == (6, 1, 8, 8) and ds.test.x.shape == (4, 1, 8, 8)
    assert ds.train.y.tolist() == [0, 0, 0, 1, 1, 1] and ds.test.y.tolist() == [0, 0, 1, 1]
    files = datasets.source_files("imagefolder", str(tmp_path))
    assert [(p.parent.parent.name, p.parent.name, p.name) for p in files[:4]] == [
        ("train", "ant", "0.png"), ("train", "ant", "1.png"), ("train", "ant", "2.png"), ("train", "cat", "0.png")]
    want = np.stack([pixels[p] for p in files[:6]])[:, None]
    assert torch.equal(ds.train.x, torch.from_numpy(want).to(torch.float32) / 255)


def test_image_folder_rgb_and_its_row_reader(tmp_path):
    pixels = _folder(tmp_path, mode="RGB", size=(4, 6))
    ds = datasets.load("imagefolder", str(tmp_path))
    first = datasets.source_files("imagefolder", str(tmp_path))[0]
    assert ds.train.x.shape == (6, 3, 4, 6)
    assert torch.equal(ds.train.x[0], torch.from_numpy(pixels[first].transpose(2, 0, 1)).to(torch.float32) / 255)
    labels = _rows_equal_full("imagefolder", str(tmp_path), {"train": np.array([5, 0, 3]), "test": np.array([2])})
    assert labels.classes == ("ant", "cat")
    # the class names are part of the digest: the same labels under other names are other data
    assert federation.label_digest(labels) != federation.label_digest(labels.train_y)


# --- LEAF ------------------------------------------------------------------------------------------------------------

def _leaf_femnist(root, train_counts=(("a.json", {"f_0": 2, "f_1": 3}), ("b.json", {"f_2": 4})),
                  test_counts=(("a.json", {"f_0": 1, "f_1": 1}), ("b.json", {"f_2": 2}))):
    """LEAF's FEMNIST layout: per split, several JSON files of users with 784 floats per sample and labels 0..61."""
    data = {}
    for split, files in (("train", train_counts), ("test", test_counts)):
        (root / split).mkdir(parents=True, exist_ok=True)
        for name, users in files:
            ud = {u: {"x": RNG.random((k, 784)).round(4).tolist(), "y": RNG.integers(0, 62, k).tolist()}
                  for u, k in users.items()}
            (root / split / name).write_text(json.dumps({"users": list(users), "num_samples": list(users.values()),
                                                         "user_data": ud}))
            data[split, name] = ud
    return data


def test_leaf_femnist_shapes_values_and_the_natural_partition(tmp_path):
    data = _leaf_femnist(tmp_path)
    ds = datasets.load("leaf", str(tmp_path))
    assert ds.train.x.shape == (9, 1, 28, 28) and ds.test.x.shape == (4, 1, 28, 28)
    f1 = data["train", "a.json"]["f_1"]
    assert torch.equal(ds.train.x[2:5].reshape(3, 784), torch.tensor(f1["x"], dtype=torch.float32))
    assert ds.train.y[2:5].tolist() == f1["y"]
    assert ds.train.owner.tolist() == [0, 0, 1, 1, 1, 2, 2, 2, 2] and ds.test.owner.tolist() == [0, 1, 2, 2]
    assert ds.num_classes == max(ds.train.y.max(), ds.test.y.max()) + 1
    b = _binding("leaf", "natural", 3)
    parts = federation.client_shards(ds, b)
    assert [p.tolist() for p in parts] == [[0, 1], [2, 3, 4], [5, 6, 7, 8]]
    assert [p.tolist() for p in federation.test_shards(ds, b)] == [[0], [1], [2, 3]]
    # an agent: labels and owners only, then its own rows, bitwise those of the full load
    labels = _rows_equal_full("leaf", str(tmp_path), {"train": parts[2], "test": np.array([3, 0])})
    assert [p.tolist() for p in federation.client_shards(labels, b)] == [p.tolist() for p in parts]
    assert [p.tolist() for p in federation.test_shards(labels, b)] == [[0], [1], [2, 3]]
    # owners are part of the data digest: the same labels given to other writers are other data
    assert federation.label_digest(labels) != federation.label_digest(labels.train_y)
    with pytest.raises(PartitionError, match=r"--clients 4: the dataset has 3 writers .* pass --clients 3"):
        federation.client_shards(ds, _binding("leaf", "natural", 4))


def test_natural_partition_needs_a_dataset_with_writers(tmp_path):
    x = RNG.integers(0, 256, (6, 8, 8), dtype=np.uint8)
    ds = datasets.load("npz", _tiny_npz(tmp_path / "d.npz", x, x))
    with pytest.raises(PartitionError, match="--partition natural: this dataset has no writers of its own"):
        federation.client_shards(ds, _binding("npz", "natural", 2))
    # other partitioners split a LEAF dataset as any other (the test split IID)
    _leaf_femnist(tmp_path / "leaf")
    leaf = datasets.load("leaf", str(tmp_path / "leaf"))
    parts = federation.client_shards(leaf, _binding("leaf", "iid", 2))
    assert sorted(np.concatenate(parts).tolist()) == list(range(9))


def test_leaf_shakespeare_characters_become_leaf_alphabet_indices(tmp_path):
    text = ("To be, or not to be: that is the question: Whether 'tis nobler in the mind to suffer\n"
            "The slings and arrows of outrageous fortune, Or to take arms against a sea of troubles")
    lines = [text[:80], text[80:160]]
    assert all(len(s) == 80 for s in lines)
    for split in ("train", "test"):
        (tmp_path / split).mkdir()
        users = {"HAMLET": (lines, ["f", "o"]), "OPHELIA": (lines[:1], ["!"])}
        (tmp_path / split / "all.json").write_text(json.dumps({
            "users": list(users), "num_samples": [len(v[1]) for v in users.values()],
            "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()}}))
    ds = datasets.load("leaf", str(tmp_path))
    assert ds.num_classes == 80 == len(LEAF_LETTERS) and ds.train.x.shape == (3, 80)
    assert ds.train.x[1].tolist() == [float(LEAF_LETTERS.index(c)) for c in lines[1]]
    assert ds.train.y.tolist() == [LEAF_LETTERS.index(c) for c in "fo!"] and ds.train.owner.tolist() == [0, 0, 1]
    _rows_equal_full("leaf", str(tmp_path), {"train": np.array([2, 0]), "test": np.array([1])})


# --- a plugin's map-style splits (the interface) ---------------------------------------------------------------------

PLUGIN = '''
import numpy as np

READ = []


class Squares:
    """A map-style split: row i is a 1x4x4 uint8 image of value 10 i, label i % 2."""
    def __init__(self, n, targets):
        self.n = n
        if targets:
            self.targets = [i % 2 for i in range(n)]

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        READ.append(i)
        return np.full((1, 4, 4), 10 * i, dtype=np.uint8), i % 2


def with_targets(data_dir):
    from edge_client.datasets import Dataset
    return Dataset("squares", Squares(8, True), Squares(4, True), num_classes=2)


def without_targets(data_dir):
    from edge_client.datasets import Dataset
    return Dataset("squares", Squares(8, False), Squares(4, False), num_classes=2)
'''


@pytest.fixture
def squares(tmp_path, monkeypatch):
    (tmp_path / "dropfl_test_squares.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    import dropfl_test_squares
    yield dropfl_test_squares
    sys.modules.pop("dropfl_test_squares", None)


def test_a_map_style_plugin_is_converted_once_and_an_agent_reads_only_its_rows(squares):
    ds = datasets.load("dropfl_test_squares:with_targets")
    assert ds.train.x.shape == (8, 1, 4, 4) and ds.train.x[3, 0, 0, 0].item() == np.float32(30 / 255)
    assert ds.train.y.tolist() == [0, 1] * 4 and sorted(squares.READ) == sorted(list(range(8)) + list(range(4)))
    squares.READ.clear()
    labels = datasets.load_labels("dropfl_test_squares:with_targets")
    assert labels.splits is not None and squares.READ == []          # targets: no row read for the labels
    got = datasets.load_rows(labels, "train", np.array([6, 1]))
    assert squares.READ == [6, 1] and torch.equal(got.x, ds.train.x[[6, 1]])
    # without targets the labels need the rows: the full load
    labels = datasets.load_labels("dropfl_test_squares:without_targets")
    assert labels.full is not None and labels.splits is None
    assert torch.equal(datasets.load_rows(labels, "train", np.array([6, 1])).x, ds.train.x[[6, 1]])


# --- errors: one line, nothing written -------------------------------------------------------------------------------

def _sim(out, *extra: str) -> int:
    return cli.main(["sim", "--out", str(out), "--rounds", "2", "--steps", "1", "--batch-size", "4", "--engine",
                     "loop", "--model", "logreg", "--threads", "1", "--no-progress", *extra])


def _bad_inputs(tmp_path):
    """(flags, what the line must say) for each kind of bad input, the files written here."""
    x = RNG.integers(0, 256, (6, 8, 8), dtype=np.uint8)
    np.savez(tmp_path / "nokey.npz", x_train=x, y_train=np.zeros(6, int), x_test=x)
    _tiny_npz(tmp_path / "range.npz", x, x, y_train=np.array([0, 1, 0, 1, 0, 3]), num_classes=np.array(2))
    _tiny_npz(tmp_path / "negative.npz", x, x, y_test=np.array([0, 1, -1, 1, 0, 1]))
    _tiny_npz(tmp_path / "floaty.npz", x.astype(np.int32), x)
    _folder(tmp_path / "mixed")
    Image.fromarray(np.zeros((8, 9), np.uint8), "L").save(tmp_path / "mixed" / "test" / "cat" / "5.png")
    _folder(tmp_path / "empty")
    (tmp_path / "empty" / "train" / "dog").mkdir()
    _leaf_femnist(tmp_path / "leaf")
    return [
        (["--dataset", "npz", "--data-dir", str(tmp_path / "missing.npz")],
         f"npz: {tmp_path / 'missing.npz'} not found: pass --data-dir FILE.npz holding arrays x_train, y_train"),
        (["--dataset", "npz"], "npz: no file given: pass --data-dir FILE.npz"),
        (["--dataset", "npz", "--data-dir", str(tmp_path / "nokey.npz")],
         f"npz: {tmp_path / 'nokey.npz'} has no array 'y_test' (it has x_test, x_train, y_train): save the arrays as"),
        (["--dataset", "npz", "--data-dir", str(tmp_path / "range.npz")],
         f"npz: {tmp_path / 'range.npz'} array 'y_train' has labels outside 0..1 (found 0 to 3): labels must be"),
        (["--dataset", "npz", "--data-dir", str(tmp_path / "negative.npz")],
         f"npz: {tmp_path / 'negative.npz'} array 'y_test' has labels outside 0..2 (found -1 to 1)"),
        (["--dataset", "npz", "--data-dir", str(tmp_path / "floaty.npz")],
         f"npz: {tmp_path / 'floaty.npz'} array 'x_train' holds int32: give uint8 images"),
        (["--dataset", "imagefolder", "--data-dir", str(tmp_path / "mixed")],
         f"imagefolder: {tmp_path / 'mixed' / 'test' / 'cat' / '5.png'} is 1x8x9 (CxHxW), but the first training "
         f"image {tmp_path / 'mixed' / 'train' / 'ant' / '0.png'} is 1x8x8: give every image the same size"),
        (["--dataset", "imagefolder", "--data-dir", str(tmp_path / "empty")],
         f"imagefolder: {tmp_path / 'empty' / 'train' / 'dog'} holds no images (.png, .jpg"),
        (["--dataset", "imagefolder", "--data-dir", str(tmp_path / "nowhere")],
         f"imagefolder: {tmp_path / 'nowhere' / 'train'} not found: --data-dir must hold train/<class>/"),
        (["--dataset", "leaf", "--data-dir", str(tmp_path / "leaf"), "--partition", "natural", "--clients", "5"],
         "--clients 5: the dataset has 3 writers and --partition natural makes each one a client: pass --clients 3"),
        (["--dataset", "leaf", "--data-dir", str(tmp_path), "--partition", "natural"],
         f"leaf: no .json files in {tmp_path / 'train'}: --data-dir must hold LEAF's train/ and test/"),
    ]


def test_bad_data_is_one_line_through_the_cli_and_nothing_is_written(tmp_path, capsys):
    for i, (flags, needle) in enumerate(_bad_inputs(tmp_path)):
        out = tmp_path / f"run{i}"
        capsys.readouterr()
        assert _sim(out, *flags) == 2, flags
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("dropfl: error: ") and needle in err[0], (needle, err)
        assert not out.exists()


def test_bad_data_is_a_user_error_through_dropfl_simulate(tmp_path):
    for i, (flags, needle) in enumerate(_bad_inputs(tmp_path)):
        opts = dict(zip(flags[::2], flags[1::2]))
        data = {"dataset": opts["--dataset"], "clients": int(opts.get("--clients", 3))}
        data.update({k: opts[f] for k, f in (("data_dir", "--data-dir"), ("partition", "--partition")) if f in opts})
        out = tmp_path / f"api{i}"
        with pytest.raises(dropfl.UserError) as e:
            dropfl.simulate({"data": data, "model": {"model": "logreg"}, "train": {"engine": "loop", "steps": 1},
                             "run": {"rounds": 2, "threads": 1}}, out=out)
        assert needle in str(e.value) and "\n" not in str(e.value)
        assert not out.exists()


def test_a_model_that_does_not_take_the_data_s_shape_is_one_line_and_nothing_is_written(tmp_path, capsys):
    """mimic-cnn's two 5x5 convolutions need images of side 16 or more: on 8x8 images the model is refused before
    the run directory exists, naming the model, the shape and where to look (not a crash.log in a new run dir)."""
    x = RNG.integers(0, 256, (6, 8, 8), dtype=np.uint8)
    _tiny_npz(tmp_path / "small.npz", x, x)
    out = tmp_path / "run"
    assert _sim(out, "--dataset", "npz", "--data-dir", str(tmp_path / "small.npz"), "--model", "mimic-cnn",
                "--partition", "iid", "--clients", "3") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dropfl: error: --model mimic-cnn: it does not take npz's inputs of "
                                               "shape (1, 8, 8) ("), err
    assert "docs/datasets.md" in err[0] and not out.exists()
    with pytest.raises(dropfl.UserError, match=r"--model mimic-cnn: it does not take npz's inputs of shape"):
        dropfl.simulate({"data": {"dataset": "npz", "data_dir": str(tmp_path / "small.npz"), "clients": 3,
                                  "partition": "iid"},
                         "model": {"model": "mimic-cnn"}, "run": {"rounds": 1}}, out=tmp_path / "api")
    assert not (tmp_path / "api").exists()


# --- end to end: a 2-round dropfl sim on each ------------------------------------------------------------------------

def _metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("kind", ["npz", "imagefolder", "leaf"])
def test_a_short_sim_on_each_loader_finishes_and_writes_metrics(tmp_path, kind):
    if kind == "npz":
        x = RNG.integers(0, 256, (24, 8, 8, 3), dtype=np.uint8)
        flags = ["--data-dir", _tiny_npz(tmp_path / "d.npz", x, x[:8]), "--clients", "3", "--partition", "iid"]
    elif kind == "imagefolder":
        _folder(tmp_path / "img", per_class=(6, 2))
        flags = ["--data-dir", str(tmp_path / "img"), "--clients", "2", "--partition", "shards"]
    else:
        _leaf_femnist(tmp_path / "leaf")
        flags = ["--data-dir", str(tmp_path / "leaf"), "--clients", "3", "--partition", "natural"]
    out = tmp_path / "run"
    assert _sim(out, "--dataset", kind, *flags) == 0
    rows = _metrics(out)
    assert [r["round"] for r in rows] == [0, 1] and all(0 <= r["accuracy"] <= 1 for r in rows)
    assert json.loads((out / "config.json").read_text())["data"]["dataset"] == kind
    assert (out / "model.pt").exists()


# --- the agent: its own shard, and a binding equal to the coordinator's ----------------------------------------------

def test_an_agent_loads_its_writers_rows_and_binds_as_the_coordinator_does(tmp_path):
    from coordinator import runsetup
    from coordinator.config import SimConfig
    from edge_client.agent import data as agent_data
    from edge_client.agent.config import AgentConfig

    _leaf_femnist(tmp_path)
    sim = SimConfig()
    sim.data.dataset, sim.data.data_dir, sim.data.partition, sim.data.clients = "leaf", str(tmp_path), "natural", 3
    sim.model.model = "logreg"
    ds = runsetup.load_dataset(sim)
    shards = runsetup.client_data(ds, runsetup.binding_of(sim, ds))
    agent = AgentConfig()
    agent.data.dataset, agent.data.data_dir, agent.data.partition, agent.data.clients = "leaf", str(tmp_path), \
        "natural", 3
    agent.model.model, agent.agent.client = "logreg", 1
    labels, x, y, tx, ty = agent_data.load_shard(agent)
    assert torch.equal(x, shards[1][0]) and torch.equal(y, shards[1][1]) and len(y) == 3
    assert np.array_equal(ty, ds.test.y.numpy()[[1]])      # writer 1's own test row
    assert agent_data.binding_of(agent, labels) == runsetup.binding_of(sim, ds)


def test_an_image_folder_of_mixed_sizes_loads_resized_by_a_plugin_that_gives_a_size(tmp_path, monkeypatch):
    (tmp_path / "dropfl_test_photos.py").write_text(
        "from edge_client.datasets_files import load_image_folder\n\n\n"
        "def photos(data_dir):\n    return load_image_folder(data_dir, size=(4, 6))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    root = tmp_path / "img"
    _folder(root)
    odd = root / "test" / "cat" / "5.png"
    Image.fromarray(RNG.integers(0, 256, (8, 9), dtype=np.uint8), "L").save(odd)
    with pytest.raises(datasets.DatasetError, match=f"{odd} is 1x8x9"):
        datasets.load("imagefolder", str(root))
    ds = datasets.load("dropfl_test_photos:photos", str(root))
    sys.modules.pop("dropfl_test_photos", None)
    assert ds.train.x.shape == (6, 1, 4, 6) and ds.test.x.shape == (5, 1, 4, 6)
    with Image.open(odd) as im:
        want = np.array(im.convert("L").resize((6, 4), Image.Resampling.BILINEAR))
    assert torch.equal(ds.test.x[-1, 0], torch.from_numpy(want).to(torch.float32) / 255)


@pytest.mark.parametrize("users,needle", [
    ({"a.json": {"u": ([[0.5] * 4], [1])}, "b.json": {"u": ([[0.5] * 4], [1])}}, "b.json repeats user 'u'"),
    ({"a.json": {"u": ([[0.5] * 4, [0.1] * 4], [1])}}, "a.json user 'u' has 2 x, 1 y"),
    ({"a.json": {"u": ([[0.5] * 4, [0.1] * 3], [1, 0])}}, "a.json user 'u' has x rows that are not lists of numbers"),
    ({"a.json": {"u": (["ab", "cd"], ["e", "fg"])}}, "a.json user 'u' has the label 'fg', not one character"),
    ({"a.json": {"u": (["a\u00e9"], ["e"])}}, "a.json user 'u' has '\u00e9', not a character of LEAF's Shakespeare"),
    ({"a.json": {"u": ([], [])}}, "a.json user 'u' has no samples"),
])
def test_malformed_leaf_files_are_one_line_naming_file_and_user(tmp_path, users, needle):
    for split in ("train", "test"):
        (tmp_path / split).mkdir()
        for name, data in users.items():
            (tmp_path / split / name).write_text(json.dumps({
                "users": list(data), "num_samples": [len(y) for _, y in data.values()],
                "user_data": {u: {"x": x, "y": y} for u, (x, y) in data.items()}}))
    with pytest.raises(datasets.DatasetError, match=needle) as e:
        datasets.load("leaf", str(tmp_path))
    assert str(e.value).startswith("leaf: ") and str(tmp_path / "train") in str(e.value) and "\n" not in str(e.value)
