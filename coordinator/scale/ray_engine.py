"""One run's rounds trained by Ray actors on several nodes: `train.engine = "ray"` (`--engine ray
--ray-address ADDRESS`), docs/scale-out.md.

`RayEngine` is the batched engine (coordinator/sim/batched.py) with its worker processes replaced by Ray
actors: a round's tasks are cut into the same `train.slices` fixed slices, each slice is trained by one
actor as one batched computation (`Group.train`, 1 thread, the kernel variant this process chose), and the
results are merged in slice order. A slice's result does not depend on which process trains it, so a run
with `--engine ray` gives the very weights of the same run with `--engine batched` and the same
`--slices` on a CPU (tests/test_ray.py), provided every node runs the same dropfl, torch and kernel
variant (each actor checks that it runs the variant it was told, and refuses otherwise).

Each actor holds the model and the data of all clients once: the data is put into Ray's object store once
(numpy arrays, read zero-copy by every actor of a node); a round ships the global weights once and each
slice's task list. Actors: min(slices, CPUs of the cluster), 1 CPU each, spread over the nodes; slice i
goes to actor i mod actors. FedDD tasks and clock-profile runs train on this process's reference loop, as
with `--engine batched` (coordinator/sim/transport.py).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from coordinator.errors import RunFailure
from coordinator.scale import cluster_cpus, connected, log
from coordinator.sim.batched import BatchedEngine, Group, _keep_freed_memory
from edge_client.trainer import LocalResult


class Trainer:
    """A Ray actor: one `Group` (model + every client's data) that trains the slices it is sent."""

    def __init__(self, model: nn.Module, x_all, y_all, offsets: list[int], sizes: list[int],
                 variant: str | None):
        import ray

        _keep_freed_memory()
        torch.set_num_threads(1)
        with warnings.catch_warnings():   # the object store's arrays are read-only; nothing writes them
            warnings.simplefilter("ignore", UserWarning)
            x, y = torch.from_numpy(x_all), torch.from_numpy(y_all)
        self.group = Group(model, x, y, offsets, sizes, "cpu", threads=1, native=variant or False)
        self.node = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        if self.group.native != variant:
            from coordinator.sim import kernels
            raise RunFailure(f"node {self.node}: the fused kernels {variant or 'off'} the run uses do not run "
                             f"here (got {self.group.native or 'torch ops'}: {kernels.error(variant) or '?'}); "
                             f"every node needs the same CPU features and a C++ compiler, or set "
                             f"DROPFL_NATIVE=0 on the driver")

    def where(self) -> tuple[str, str]:
        """This actor's node: (address, Ray node id; several nodes may share an address on one machine)."""
        return self.node, self.node_id

    def train(self, w_global: torch.Tensor, tasks: list, data=None, start=None, terms=None) -> list[LocalResult]:
        return self.group.train(w_global, tasks, data, start, terms)


class RayEngine(BatchedEngine):
    """`BatchedEngine`'s interface (run, describe, details, slices, close) with Ray actors as its workers."""

    def __init__(self, model: nn.Module, client_data: list[tuple[torch.Tensor, torch.Tensor]], groups: int = 2,
                 address: str | None = None, native: bool | str = True):
        # the batched engine in this process, on the CPU: its data layout, model copy and kernel variant
        super().__init__(model, client_data, workers=0, groups=groups, device="cpu", native=native)
        local, self.local = self.local, None
        conn = connected(address, "--engine ray")
        ray = conn.__enter__()
        self._conn = conn
        try:
            n = min(self.groups, cluster_cpus(ray))
            x_ref, y_ref = ray.put(local.x_all.numpy()), ray.put(local.y_all.numpy())
            actor = ray.remote(num_cpus=1)(Trainer).options(scheduling_strategy="SPREAD")
            self.actors = [actor.remote(local.model, x_ref, y_ref, local.offsets, local.sizes, self.native)
                           for _ in range(n)]
            self.nodes = ray.get([a.where.remote() for a in self.actors])   # waits for (and checks) every actor
        except BaseException as e:
            self.close()
            cause = getattr(e, "cause", None)
            raise (cause if isinstance(cause, RunFailure) else e) from None
        self.ray = ray
        log.debug("ray engine: %d actors on %d node(s)", n, len(set(self.nodes)))

    def describe(self) -> str:
        """"ray:" and what each slice runs (the batched engine's name): "ray:batched+native(avx2)"."""
        return "ray:" + super().describe()

    def details(self) -> dict:
        d = super().details()
        addresses = sorted({ip for ip, _ in self.nodes})
        nodes = len(set(self.nodes))
        return d | {"device": f"Ray ({nodes} node(s) at {', '.join(addresses)})", "workers": len(self.actors),
                    "actors": len(self.actors), "nodes": nodes}

    def run_parts(self, parts: list[tuple]) -> list[list[LocalResult]]:
        """Each part to actor i mod actors; the results in the order of `parts` (a fixed merge order)."""
        if not parts:
            return []
        w = self.ray.put(parts[0][0])
        refs = [self.actors[i % len(self.actors)].train.remote(w if p[0] is parts[0][0] else p[0], *p[1:])
                for i, p in enumerate(parts)]
        try:
            return self.ray.get(refs)
        except self.ray.exceptions.RayActorError as e:   # a node lost, an actor killed: the round cannot finish
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RunFailure(f"--engine ray: an actor stopped during the round ({first}); continue the run from "
                             f"its last checkpoint with --resume") from None

    def close(self) -> None:
        conn, self._conn = getattr(self, "_conn", None), None
        if conn is None:
            return
        import ray
        for a in getattr(self, "actors", []):
            ray.kill(a)
        self.actors = []
        conn.__exit__(None, None, None)
