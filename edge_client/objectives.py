"""Local objectives: what a client does differently in local training, as one typed object on the task.

A strategy attaches objectives to the task it configures (`TrainTask.objectives`); the reference loop
(`edge_client/trainer.py`), the batched engines (coordinator/sim/batched.py, functional.py) and the device agent
apply them from the task, and a field trial sends them in the task message by registry name (docs/objectives.md,
docs/protocol.md). An objective is a frozen dataclass of its parameters: numbers, strings and booleans, plus
named tensors (float32 on the wire: a flat vector in the model's `get_flat` layout, or any shape the objective
splits itself). It changes local SGD through two hooks, both given the client's parameters (model order and
shapes, as `model.parameters()`) and the global parameters at the round's start (`anchor`, the same layout):

- `loss(params, anchor)`: a scalar added to the client's cross-entropy before backward (None: nothing);
- `gradient(grads, params, anchor)`: the gradients after backward, returned with the objective's correction
  (default: unchanged), before `w ← w − lr·g`.

Objectives apply in the task's order. The built-ins, registered below exactly as a plugin is:

    proximal    FedProx (Li et al., MLSys 2020): μ/2 ‖w − w_t‖², applied as its gradient g + μ(w − w_t)
    correction  SCAFFOLD (Karimireddy et al., ICML 2020) Alg. 1 line 10: g + (c − c_i)

The batched engines run these two with their own stacked (and native) arithmetic, which has the loop's bits
(`builtin_terms`); any other objective, or these in another order, is applied client by client from the two hooks.
A plugin objective is a subclass of `LocalObjective` with a `name` (its registry name, the one on the wire),
registered under entry point group `dropfl.objectives` (or named as module:attr in simulation).

FedDD's dropout rate is not one: it does not change the local loss or the gradient, but which part of the trained
model is uploaded (and downloaded) and the device's memory of its masks, so it stays `TrainTask.dropout_rate`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import ClassVar

import torch

from edge_client.registry import PluginError, Registry

_SCALARS = (bool, int, float, str)


@dataclasses.dataclass(frozen=True)
class LocalObjective:
    """Base of every local objective. A subclass is a frozen dataclass whose fields are its parameters (bool,
    int, float, str, or torch.Tensor) and whose `name` is its registry name."""

    name: ClassVar[str] = ""

    def loss(self, params: Sequence[torch.Tensor], anchor: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """A term added to the client's loss (differentiated by autograd), or None."""
        return None

    def gradient(self, grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor],
                 anchor: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The gradients with this objective's correction added (new tensors; never written in place)."""
        return list(grads)

    # --- moving and the wire ----------------------------------------------------------------------------------
    def to(self, device: torch.device | str) -> LocalObjective:
        """A copy with every tensor parameter on `device` (itself where they already are)."""
        moved = {f.name: v.to(device) for f in dataclasses.fields(self)
                 if isinstance(v := getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **moved) if moved else self

    def to_wire(self) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
        """(plain JSON parameters, named tensors) of this objective."""
        params, tensors = {}, {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                tensors[f.name] = v
            elif v is None or isinstance(v, _SCALARS):
                params[f.name] = v
            else:
                raise TypeError(f"local objective {self.name!r}: parameter {f.name} is a {type(v).__name__}, "
                                f"not a number, string, boolean or tensor")
        return params, tensors

    @classmethod
    def from_wire(cls, params: Mapping[str, object], tensors: Mapping[str, torch.Tensor]) -> LocalObjective:
        """The objective from `to_wire`'s parts (ValueError/TypeError on a missing, unknown or mistyped one)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = (set(params) | set(tensors)) - fields
        if unknown:
            raise ValueError(f"local objective {cls.name!r}: unknown parameter(s) {', '.join(sorted(unknown))}")
        for k, v in params.items():
            if v is not None and not isinstance(v, _SCALARS):
                raise TypeError(f"local objective {cls.name!r}: parameter {k} is a {type(v).__name__}")
        return cls(**params, **tensors)


def split_like(flat: torch.Tensor, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A flat vector in `get_flat`'s layout as views shaped like `params`."""
    return [c.view_as(p) for c, p in zip(torch.split(flat, [p.numel() for p in params]), params)]


@dataclasses.dataclass(frozen=True)
class Proximal(LocalObjective):
    """FedProx: the local loss F_i(w) + (μ/2)‖w − w_t‖², applied as the gradient g + μ(w − w_t) (μ = 0: nothing)."""

    mu: float
    name: ClassVar[str] = "proximal"

    def __post_init__(self):
        if not (isinstance(self.mu, (int, float)) and math.isfinite(self.mu) and self.mu >= 0):
            raise ValueError(f"local objective 'proximal': mu must be a finite number >= 0 (got {self.mu!r})")

    def gradient(self, grads, params, anchor):
        if not self.mu:
            return list(grads)
        return [g + self.mu * (p - a) for g, p, a in zip(grads, params, anchor)]   # FedProx: ∇ of μ/2‖w − w_t‖²


@dataclasses.dataclass(frozen=True, eq=False)
class Correction(LocalObjective):
    """SCAFFOLD's control-variate correction: every gradient + (c − c_i), `c` flat in `get_flat`'s layout."""

    c: torch.Tensor
    name: ClassVar[str] = "correction"

    def __post_init__(self):
        if not isinstance(self.c, torch.Tensor) or self.c.dim() != 1:
            raise ValueError("local objective 'correction': c must be a flat tensor [num_params]")

    def gradient(self, grads, params, anchor):
        if self.c.numel() != sum(p.numel() for p in params):
            raise ValueError(f"local objective 'correction': c has {self.c.numel()} values, the model "
                             f"{sum(p.numel() for p in params)} parameters")
        return [g + c for g, c in zip(grads, split_like(self.c.to(params[0].device), params))]   # SCAFFOLD l. 10


def _is_objective(obj) -> str | None:
    if (isinstance(obj, type) and issubclass(obj, LocalObjective) and "__dataclass_params__" in vars(obj)
            and obj.__dataclass_params__.frozen and isinstance(obj.name, str) and obj.name and ":" not in obj.name):
        return None
    return "a local objective (a frozen dataclass subclass of LocalObjective with a `name`)"


OBJECTIVES = Registry("local objective", "dropfl.objectives", check=_is_objective)
OBJECTIVES.register(Proximal.name, Proximal)
OBJECTIVES.register(Correction.name, Correction)


# --- what the engines read ------------------------------------------------------------------------------------
def find(objectives: Iterable[LocalObjective], cls: type) -> LocalObjective | None:
    return next((o for o in objectives if type(o) is cls), None)


def proximal_mu(objectives: Iterable[LocalObjective]) -> float:
    """FedProx's μ among `objectives` (0.0 without a proximal objective)."""
    o = find(objectives, Proximal)
    return 0.0 if o is None else float(o.mu)


def correction_of(objectives: Iterable[LocalObjective]) -> torch.Tensor | None:
    """SCAFFOLD's c − c_i among `objectives` (None without a correction)."""
    o = find(objectives, Correction)
    return None if o is None else o.c


def builtin_only(objectives: Sequence[LocalObjective]) -> bool:
    """Whether `objectives` are at most one proximal then at most one correction, in that order: the form the
    batched engines' stacked and native arithmetic applies with the loop's bits (g + μ(w − w_t), then + c)."""
    kinds = [type(o) for o in objectives]
    return kinds in ([], [Proximal], [Correction], [Proximal, Correction])


def with_objective(objectives: Sequence[LocalObjective], new: LocalObjective | None, cls: type
                   ) -> tuple[LocalObjective, ...]:
    """`objectives` with its `cls` objective replaced by `new` (appended where it has none; removed for None),
    the built-ins kept in the order proximal, correction."""
    out = [o for o in objectives if type(o) is not cls]
    if new is not None:
        at = len(out)
        if cls is Proximal:   # before a correction, as the engines apply them
            at = next((i for i, o in enumerate(out) if type(o) is Correction), at)
        out.insert(at, new)
    return tuple(out)


def apply_stacked(objectives: Sequence[Sequence[LocalObjective]], grads: Sequence[torch.Tensor],
                  params: Sequence[torch.Tensor], anchor: Sequence[torch.Tensor], stacked_anchor: bool = False,
                  layout=lambda t: t) -> list[torch.Tensor]:
    """The batched engines' gradient hooks, client by client: client i's parameters and gradients are row i of
    the stacks [k, *shape]; `anchor` is shared ([*shape]) or per client (`stacked_anchor`); `layout` maps an
    engine tensor to the model's layout and back (its own inverse, like batched.py's `_held`)."""
    out = list(grads)
    for i, objs in enumerate(objectives):
        if not objs:
            continue
        g_i = [layout(g[i]) for g in out]
        p_i = [layout(p[i]) for p in params]
        a_i = [layout(a[i] if stacked_anchor else a) for a in anchor]
        for o in objs:
            g_i = o.gradient(g_i, p_i, a_i)
        for j, g in enumerate(g_i):
            if out[j] is grads[j]:
                out[j] = grads[j].clone()
            out[j][i] = layout(g)
    return out


def loss_stacked(objectives: Sequence[Sequence[LocalObjective]], params: Sequence[torch.Tensor],
                 anchor: Sequence[torch.Tensor], stacked_anchor: bool = False,
                 layout=lambda t: t) -> torch.Tensor | None:
    """The sum over clients of their objectives' loss terms, from stacks [k, *shape] (as `apply_stacked`)."""
    total = None
    for i, objs in enumerate(objectives):
        for o in objs:
            term = o.loss([layout(p[i]) for p in params], [layout(a[i] if stacked_anchor else a) for a in anchor])
            if term is not None:
                total = term if total is None else total + term
    return total


# --- the task message ---------------------------------------------------------------------------------------
@functools.cache
def identity(name: str) -> dict:
    """The identity of the code behind the objective `name` in this process (`edge_client.federation.PluginId`:
    distribution, version and code digest; dropfl and its version for a built-in), as the wire carries it. Read
    once per process: the code a process has loaded does not change under it."""
    from edge_client.federation import plugin_id  # imports the model registry (torch-heavy): only when needed
    p = plugin_id("objective", name, OBJECTIVES)
    return {"dist": p.dist, "version": p.version, "digest": p.digest}


def describe_identity(ident: dict) -> str:
    from edge_client.federation import PluginId
    return PluginId("objective", "", *(ident.get(k, "") for k in ("dist", "version", "digest"))).describe()


def encode(objectives: Sequence[LocalObjective]) -> tuple[list[dict], torch.Tensor | None]:
    """The task message's `objectives` meta and tensor: each objective as {"name", "params", "tensors":
    {field: numel}, "plugin": its code's identity (`identity`)}, its tensors flattened to float32 and
    concatenated, in order, into the message's one tensor."""
    meta, parts = [], []
    for o in objectives:
        params, tensors = o.to_wire()
        item: dict = {"name": o.name, "params": params, "plugin": identity(o.name)}
        if tensors:
            item["tensors"] = {k: int(t.numel()) for k, t in tensors.items()}
            parts += [t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors.values()]
        meta.append(item)
    return meta, (None if not parts else parts[0] if len(parts) == 1 else torch.cat(parts))


def installed(name: object) -> type[LocalObjective]:
    """The objective class a message names, from this process's registry: registered names and installed entry
    points only. A module:attr name is refused, never imported: a message must not choose code to run."""
    if not isinstance(name, str) or ":" in name:
        raise PluginError("local objective", name, "not installed on this device (a task names an objective by "
                          "its registered name; install the plugin that provides it)")
    try:
        return OBJECTIVES.entry(name).obj   # type: ignore[return-value]
    except PluginError:
        raise PluginError("local objective", name, "not installed on this device: install the plugin that "
                          "provides it (entry point group dropfl.objectives)") from None


def legacy(prox_mu: object, tensor: torch.Tensor | None) -> tuple[LocalObjective, ...]:
    """The objectives of a task message in the older form, without `objectives`: meta `prox_mu` (FedProx's μ) and
    the message's tensor as SCAFFOLD's correction."""
    mu = float(prox_mu)   # type: ignore[arg-type]
    return with_objective((Proximal(mu),) if mu else (), None if tensor is None else Correction(tensor.reshape(-1)),
                          Correction)


def decode(meta: object, tensor: torch.Tensor | None) -> tuple[LocalObjective, ...]:
    """`encode`'s inverse on the device. PluginError for an objective not installed here, or installed from other
    code than the coordinator's (another distribution, version or code digest: the item's `plugin`; an item
    without it, from an older coordinator, is not checked); ValueError/TypeError for a malformed list (tensor sizes
    that do not add up to the message's tensor, a bad parameter)."""
    if not isinstance(meta, list):
        raise TypeError(f"objectives must be a list (got {type(meta).__name__})")
    if tensor is not None and tensor.dtype != torch.float32:
        raise TypeError(f"the objectives' tensor must be float32 (got {tensor.dtype})")
    flat = None if tensor is None else tensor.reshape(-1)
    at, out = 0, []
    for item in meta:
        if not isinstance(item, dict) or not isinstance(item.get("params", {}), dict) \
                or not isinstance(item.get("tensors", {}), dict):
            raise TypeError("an objective must be {name, params, tensors}")
        cls = installed(item.get("name"))
        want = item.get("plugin")
        if want is not None:
            if not isinstance(want, dict) or not all(isinstance(want.get(k), str) for k in ("dist", "version",
                                                                                              "digest")):
                raise TypeError(f"objective {cls.name!r}: plugin must be {{dist, version, digest}} strings")
            have = identity(cls.name)
            if {k: want[k] for k in have} != have:
                fix = f"{want['dist']} {want['version']}" if want["dist"] else "the coordinator's code"
                raise PluginError("local objective", cls.name,
                                  f"differs from the coordinator's (on this device: {describe_identity(have)}; on the "
                                  f"coordinator: {describe_identity(want)}): install {fix} on the device")
        tensors = {}
        for k, n in item.get("tensors", {}).items():
            if not isinstance(n, int) or isinstance(n, bool) or n < 0 or flat is None or at + n > flat.numel():
                raise ValueError(f"objective {cls.name!r}: tensor {k} of {n!r} values does not fit the message")
            tensors[k], at = flat[at:at + n], at + n
        out.append(cls.from_wire(item.get("params", {}), tensors))
    if flat is not None and at != flat.numel():
        raise ValueError(f"the task's tensor has {flat.numel()} values, its objectives name {at}")
    return tuple(out)
