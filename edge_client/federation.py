"""What makes a federation one experiment: its data binding, and the client shards it implies.

The **data binding** is everything an edge agent must share with the coordinator so that its shard,
its model and its training are the ones the simulation (and a replay) would use. It is declared once,
here, as `DataBinding`; the coordinator builds it from its `SimConfig` (`BINDING_SOURCE` names the
config field of each binding key, `coordinator/runsetup.py`), an agent from its config file's `[data]`
and `[model]` sections, and the coordinator refuses an agent whose binding differs, naming the fields
(`diff`). `data_digest` binds the data itself (a digest of the training labels, and of the rows' writers and
the class names where a dataset has them: `label_digest`), not the path it was read from: two hosts keep their
datasets in different directories.

`plugins` binds the code the agent runs for the binding's model, dataset and partitioner (`plugin_ids`): one
`PluginId` per name, with its distribution, version and a digest of its code; a built-in is identified by
dropfl's own version (no other field of the binding pins it). Computing it imports nothing: the agent's names
come from its own config file, never from a message, and the coordinator compares the agent's announce with its
own binding (coordinator/field/registry.py, `refusal`), so a name the coordinator uses is never resolved on the
device.

`client_shards` is the one place that turns a binding into per-client index arrays; simulation and
agents both call it. Lives on the device side because the agent may not import `coordinator`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import numpy as np

from edge_client import datasets, partition
from edge_client.registry import BUILT_IN_PACKAGES, Registry

BUILT_IN = "dropfl"   # the distribution that identifies a built-in


@dataclass(frozen=True)
class PluginId:
    """The identity of the code behind one name of the binding: `kind` (model, dataset, partitioner), the
    configured `name`, the distribution that provides it and its version (`dropfl` and dropfl's version for a
    built-in; "" where no installed distribution holds the module), and `digest`: 16 hex digits of SHA-256 over
    the Python source files (*.py) of the plugin's top-level package (`code_digest`; "" for a built-in)."""
    kind: str
    name: str
    dist: str
    version: str
    digest: str

    def describe(self) -> str:
        if not self.dist and not self.digest:
            return "not installed"
        where = f"{self.dist} {self.version}" if self.dist else "no installed distribution"
        return where + (f" (code digest {self.digest})" if self.digest else "")


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
    plugins: tuple[PluginId, ...] = ()   # the code behind model, dataset and partition (`plugin_ids`)

    def to_meta(self) -> dict:
        return dataclasses.asdict(self) | {"plugins": [dataclasses.asdict(p) for p in self.plugins]}


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
    values = {k: getattr(sections[s], f) for k, (s, f) in BINDING_SOURCE.items()}
    return DataBinding(**values, data_digest=data_digest,
                       plugins=plugin_ids(values["model"], values["dataset"], values["partition"]))


# --- plugin identities ------------------------------------------------------------------------------------------

def _registries() -> dict[str, Registry]:
    from edge_client.models import MODELS  # torch-heavy: imported when a binding is made, not with this module
    return {"model": MODELS, "dataset": datasets.DATASETS, "partitioner": partition.PARTITIONERS}


@functools.lru_cache(maxsize=1)
def dropfl_version() -> str:
    """dropfl's installed version (read once: a binding is made for every run of a sweep)."""
    try:
        return metadata.version(BUILT_IN)
    except metadata.PackageNotFoundError:
        return ""


def _code_files(module: str) -> list[tuple[str, Path]]:
    """(relative name, path) of every *.py file of `module`'s top-level package (or its one file), found without
    importing it: sys.modules if it is loaded, else `importlib.util.find_spec` of the top-level name."""
    top = module.split(".")[0]
    loaded = sys.modules.get(top)
    if loaded is not None:
        roots, origin = list(getattr(loaded, "__path__", []) or []), getattr(loaded, "__file__", None)
    else:
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            return []
        roots, origin = list(spec.submodule_search_locations or []), spec.origin
    if roots:
        files = []
        for root in map(Path, roots):
            files += [(f"{top}/{p.relative_to(root).as_posix()}", p) for p in root.rglob("*.py")
                      if "__pycache__" not in p.parts]
        return sorted(files)
    return [(Path(origin).name, Path(origin))] if origin and origin.endswith(".py") else []


def code_digest(module: str) -> str:
    """16 hex digits of SHA-256 over the *.py files of `module`'s top-level package, each as its path relative to
    the package's parent and its bytes, in path order ("" if none is found). The same code digests the same from
    a wheel, an editable install or a source tree; an installed distribution's RECORD is not used, as an editable
    install's lists no code, and its metadata files (INSTALLER, direct_url.json) differ between installs of the
    same code. Compiled extension modules and data files are not digested (their distribution's version is)."""
    files = _code_files(module)
    if not files:
        return ""
    h = hashlib.sha256()
    for rel, path in files:
        h.update(rel.encode() + b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:16]


def _dist_of(module: str) -> tuple[str, str]:
    top = module.split(".")[0]
    for name in metadata.packages_distributions().get(top, []):
        try:
            return metadata.distribution(name).metadata["Name"], metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "", ""


def _module_of_name(registry: Registry, name: str) -> tuple[str, tuple[str, str] | None] | None:
    """(module of the code behind `name`, its (distribution, version) if known) without importing it; None for a
    name this process cannot resolve. Follows the registry's order: registered, entry point, module:attr."""
    if name in registry.registered():
        obj = registry.entry(name).obj     # registered: already imported
        return getattr(obj, "__module__", None) or type(obj).__module__, None
    for ep in registry.entry_points():
        if ep.name == name:
            dist = getattr(ep, "dist", None)
            return ep.module, (None if dist is None else (dist.metadata["Name"], dist.version))
    if ":" in name:
        return name.partition(":")[0], None
    return None


def plugin_id(kind: str, name: str, registry: Registry | None = None) -> PluginId:
    """The identity of the code this process would run for the `kind` named `name` (see `PluginId`)."""
    registry = _registries()[kind] if registry is None else registry   # (a Mapping: `or` would list it)
    found = _module_of_name(registry, name)
    if found is None:
        return PluginId(kind, name, "", "", "")
    module, dist = found
    if module.split(".")[0] in BUILT_IN_PACKAGES:
        return PluginId(kind, name, BUILT_IN, dropfl_version(), "")
    dist_name, version = dist or _dist_of(module)
    return PluginId(kind, name, dist_name, version, code_digest(module))


def plugin_ids(model: str, dataset: str, partition_name: str) -> tuple[PluginId, ...]:
    regs = _registries()
    return tuple(plugin_id(kind, name, regs[kind])
                 for kind, name in (("model", model), ("dataset", dataset), ("partitioner", partition_name)))


def _plugins_of(meta: dict) -> dict[tuple[str, str], dict]:
    got = meta.get("plugins")
    if not isinstance(got, list):
        return {}
    return {(p.get("kind"), p.get("name")): p for p in got if isinstance(p, dict)}


def plugin_diff(mine: DataBinding, theirs: dict) -> list[tuple[PluginId, dict | None]]:
    """(my plugin, theirs or None) for each plugin of mine whose distribution, version or digest differs from
    the announce's (a missing one differs, except a built-in of an announce without `plugins`: an older agent)."""
    if "plugins" not in theirs and all(p.dist == BUILT_IN for p in mine.plugins):
        return []
    have = _plugins_of(theirs)
    out = []
    for p in mine.plugins:
        t = have.get((p.kind, p.name))
        if t is None or (t.get("dist"), t.get("version"), t.get("digest")) != (p.dist, p.version, p.digest):
            out.append((p, t))
    return out


def diff(mine: DataBinding, theirs: dict) -> dict[str, tuple]:
    """{key: (theirs, mine)} for every binding key whose value differs (a missing key differs); `plugins`:
    (theirs, mine) as lists of dicts, when `plugin_diff` finds one."""
    out = {}
    for k, v in dataclasses.asdict(mine).items():
        if k == "plugins":
            if plugin_diff(mine, theirs):
                out[k] = (theirs.get(k), mine.to_meta()[k])
            continue
        if k == "data_digest" and (not v or not theirs.get(k)):
            continue  # one side did not compute it (older agent): the other keys still bind
        if theirs.get(k) != v:
            out[k] = (theirs.get(k), v)
    return out


def refusal(mine: DataBinding, theirs: dict) -> str | None:
    """None if an agent's announce `theirs` has the coordinator's binding `mine`, else one line: the differing
    fields (agent's value, coordinator's), each differing plugin named, with what to install on the device."""
    d = diff(mine, theirs)
    if not d:
        return None
    parts = [f"{k} (agent {a!r}, coordinator {c!r})" for k, (a, c) in d.items() if k != "plugins"]
    for p, t in plugin_diff(mine, theirs):
        agent = "none" if t is None else PluginId(
            p.kind, p.name, str(t.get("dist") or ""), str(t.get("version") or ""), str(t.get("digest") or "")
        ).describe()
        todo = (f"install {p.dist} {p.version} on the device" if p.dist and p.dist != BUILT_IN
                else f"install dropfl {p.version} on the device" if p.dist == BUILT_IN
                else f"put the same module {p.name.partition(':')[0]} on the device")
        if p.digest and t is not None and (t.get("dist"), t.get("version")) == (p.dist, p.version):
            todo += " (same version, other code: reinstall it from the coordinator's build)"
        parts.append(f"{p.kind} plugin {p.name!r} differs (on the agent: {agent}; on the coordinator: "
                     f"{p.describe()}): {todo}")
    return "data binding differs: " + "; ".join(parts)


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
