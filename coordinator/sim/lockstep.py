"""Lockstep: runs of a sweep that share a dataset and a model advance round by round together, and the
local training of round t of all of them is ONE call of one batched engine (coordinator/sim/batched.py).

How: every run is `run_sim` in its own thread, unchanged: its own round loop, run directory,
checkpoints and resume. Its SimTransport gets a `_Proxy` instead of a BatchedEngine
(`run_sim(make_engine=...)`): the proxy hands the round's tasks to the group's `Lockstep` and waits.
When every run still running has handed in its round, the tasks of all of them are trained in the
worker processes of one shared engine, which holds the data of every run (runs whose shards are
equal share one copy), and each run gets its results back.

Turns: a run's thread holds the group's lock whenever it runs its own code and gives it up only while it
waits for its results, and while it evaluates its global model (`Lockstep.evaluating`: at most one evaluation
per CPU at once). So outside training and evaluation only one run computes at a time, with the process-wide
state (torch's thread count, logging) exactly as a serial sweep has it, and nothing of a run interleaves with
another's except at `run_round` and `evaluate`. Each run's log records go to its own log.txt/log.jsonl
(`_Router`). Why evaluations overlap: the training workers wait while the runs take their turns after a round,
and the runs' evaluations (10,000 test images each) were most of that wait, one at a time on one core (py-spy
on the uniform Table 3: the workers idle ~22 % of rounds 1+). An evaluation is a pure function of the run's
weights (its own Evaluator or model; each sample's logits the same bits in any batch, with any thread count,
alone or beside another evaluation: tests/test_sweep.py compares every metric with the serial executor's).

Exactness (tests/test_sweep.py: model.pt and metrics bitwise equal to the serial executor's):
1. The serial executor's engine cuts a run's tasks into `slices` and trains each as one computation.
   A client's result does not depend on which other clients share its computation on the paths
   `_merges` admits: the fused native LeNet layers (one client after another inside the kernel) and
   batched matmuls (one GEMM per client); measured bit for bit, alone, in any order, with any neighbours
   (tests/test_sweep.py). Torch's grouped convolutions round differently with the number of groups:
   a run on that path (no native kernels) trains its own slices alone, as the serial executor does.
2. `Group._train` makes some choices per computation: one lr (then `add_(alpha=-lr)`) or several
   (`addcmul_`), the padding width (the batch size), whether FedProx's μ term and SCAFFOLD's correction
   are added. A slice is merged only with slices that make the same choices (`_key`); others train alone.
   With the fused update (`kernels.fused_update`: one pass per parameter, the terms chosen per client) the
   terms are not a per-computation choice: each task carries its own slice's (`terms`), and plain, FedProx
   and SCAFFOLD slices of one lr and batch size merge. In the uniform Table 3 that is 2 computations a round
   instead of 6, of ~15 clients instead of 3-9: a step's fixed cost (~40 small ops, 4 kernel calls) is paid a
   third as often.
3. Identical tasks train once (`_unique`): two merged tasks with the same start weights bit for bit, the same
   client data, every task field equal and the same terms get the same result by 1., so the second gets a copy
   of the first's. Runs that differ only in the server's aggregation (FedAvg, MIFA, MimiC) or only in the
   availability (τmax) hand in identical tasks whenever they start a round from one model: round 0 of MimiC's
   Table 3, where every client trains from the trial's initial model (450 tasks of a trial's 15 runs, 90
   distinct), and the clients two of them share in round 1. `dropfl reproduce` orders its jobs trial by trial so
   that the groups are trials.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace

import torch

from coordinator.sim.batched import BatchedEngine, Group, auto_device, batch_independent, cpus
from coordinator.sim.kernels import fused_update
from coordinator.strategies import STRATEGIES
from edge_client import logs
from edge_client.models import MODELS
from edge_client.objectives import builtin_only
from edge_client.trainer import LocalResult, TrainTask


def why_not(cfg) -> str | None:
    """Why a run cannot join a lockstep group (it then runs serially), or None."""
    if cfg.train.engine != "batched":
        return f"--engine {cfg.train.engine}"
    if cfg.clock.profile:
        return "a clock profile (its clients train on the reference loop)"
    cls = STRATEGIES.get(cfg.strategy.algo)
    if cls is None or getattr(cls, "sets_dropout_rate", False):
        return f"--algo {cfg.strategy.algo} (its tasks train on the reference loop)"
    # a fact declared with the model (edge_client/models.py); the LeNets' holds with their native kernels, which
    # `_merges` checks on the run's own model and data
    if not MODELS.meta(cfg.model.model, "batch_independent"):
        return (f"--model {cfg.model.model}: its torch grouped convolutions round differently with the number "
                "of clients in a batch, so merged runs would not be exact")
    if getattr(cfg.run, "track", None):
        return "--track (the trackers keep process-wide state)"
    if (cfg.train.device if cfg.train.device != "auto" else auto_device(cfg.model.model)) != "cpu":
        return (f"CUDA (--sim-device {cfg.train.device}: that a client's result is independent of its batch is "
                "checked on the CPU paths only)")
    return None


def group_key(cfg) -> tuple:
    """Runs with equal keys share one lockstep group: same data, model, local work per task, and --slices
    (how the serial executor's engine cuts a round, which the group keeps)."""
    return (cfg.data.dataset, cfg.data.data_dir, cfg.model.model, cfg.model.dropout, cfg.train.batch_size,
            cfg.train.epochs, cfg.train.steps, cfg.run.threads, getattr(cfg.train, "slices", 2))


def _merges(model: torch.nn.Module, group: Group) -> bool:
    """Whether this engine path gives each client the same bits whatever clients share its computation."""
    return batch_independent(model, group.native, group.x_all.dtype, group.device)


def _key(tasks: list[TrainTask], merges: bool, fused: bool = False) -> tuple[tuple, int] | None:
    """What `Group._train` decides per computation for these tasks (a serial slice), and the terms its update adds
    to each of them (`Group.train(terms=...)`: 1 FedProx's, 2 SCAFFOLD's correction); None: train alone. With the
    fused update the terms are per task, so they are not part of the key. A plugin's local objective: alone."""
    lrs, sizes, mus = {t.lr for t in tasks}, {t.batch_size for t in tasks}, {t.prox_mu for t in tasks}
    if not merges or len(lrs) != 1 or len(sizes) != 1 or len(mus) != 1 \
            or not all(builtin_only(t.objectives) for t in tasks):
        return None
    mu, corrected = mus.pop(), any(t.grad_correction is not None for t in tasks)
    terms = (1 if mu else 0) | (2 if corrected else 0)
    return ((lrs.pop(), sizes.pop()) if fused else (lrs.pop(), sizes.pop(), mu, corrected)), terms


class _Router(logging.Handler):
    """Sends each log record to the log files of the run whose thread wrote it."""

    def __init__(self) -> None:
        super().__init__()
        self.files: dict[int, list[logging.Handler]] = {}
        self._dropfl = "lockstep"

    def take(self) -> None:
        """Move the run files `setup_run` just attached (logs.attach_run_files) to this thread's records."""
        root = logging.getLogger(logs.ROOT)
        mine = [h for h in root.handlers if getattr(h, "_dropfl", None) == "run"]
        for h in mine:
            root.removeHandler(h)
        self.files[threading.get_ident()] = mine

    def emit(self, record: logging.LogRecord) -> None:
        for h in self.files.get(record.thread, ()):
            if record.levelno >= h.level:
                h.handle(record)

    def close(self) -> None:
        for hs in self.files.values():
            for h in hs:
                h.close()
        super().close()


@dataclass
class _Request:
    w: torch.Tensor
    tasks: list[TrainTask]
    base: int          # this run's client 0 in the shared engine's data
    merges: bool
    fused: bool        # the engine updates FedProx/SCAFFOLD clients with the fused kernel (terms per client)


def _digest(w: torch.Tensor) -> bytes:
    """The bits of a run's global weights, as a key."""
    return hashlib.blake2b(w.contiguous().numpy().tobytes(), digest_size=16).digest()


def _task_identity(t: TrainTask) -> tuple:
    """Every field of a task, tensors (SCAFFOLD's correction) by their bits."""
    return tuple(_digest(v) + str(v.dtype).encode() if isinstance(v, torch.Tensor) else v
                 for v in (getattr(t, f.name) for f in fields(t)))


def _unique(members: list[tuple[int, int, int]], requests: dict[int, _Request], digests: dict[int, bytes],
            copies: list[tuple[tuple[int, int], tuple[int, int]]]) -> list[tuple[int, int, int]]:
    """The merged tasks (rid, task index, terms) less those identical to an earlier one, which are added to
    `copies` as ((rid, i), (rid0, i0)): the same start weights bit for bit, the same client data, every field of
    the task and the same terms. On the merged paths a task's result is a function of exactly these (whatever
    else shares its computation: see the module's docstring), so the copy is the very result training it again
    would give. Where that happens: the runs of a sweep that differ only in what the server does with the
    updates (FedAvg, MIFA, MimiC) or only in the availability (τmax) start from one initial model and, in a
    round where everyone trains (round 0 of MimiC's Table 3), hand in the same tasks: 90 distinct of the 450 in a
    group of one trial's 15 runs."""
    first: dict[tuple, tuple[int, int]] = {}
    kept = []
    for r, i, terms in members:
        req = requests[r]
        t = req.tasks[i]
        key = (digests[r], req.base + t.client, terms, _task_identity(t))
        if key in first:
            copies.append(((r, i), first[key]))
        else:
            first[key] = (r, i)
            kept.append((r, i, terms))
    return kept


class Lockstep:
    """One lockstep group: its runs' turns, their submitted rounds, and the shared engine."""

    def __init__(self, runs: int, workers: int | None = None, progress: Callable[[str], None] | None = None,
                 slices: int = 2):
        self.cv = threading.Condition(threading.Lock())
        self.live, self.workers, self.progress, self.slices = runs, workers, progress, slices
        self.pending: dict[int, _Request] = {}
        self.copied = 0   # tasks not trained because an identical task of another run was (`_unique`)
        self.done: dict[int, list[LocalResult]] = {}
        self.blocks: dict[str, int] = {}          # digest of a run's shards → its first client in `data`
        self.data: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.model: torch.nn.Module | None = None
        self.engine: BatchedEngine | None = None
        # the engine is built, used and closed on this one thread, which lives as long as the group: its worker
        # processes die with the thread that started them (PR_SET_PDEATHSIG, batched._die_with_parent), and a
        # run's own thread may end before the others' (it diverged, or has fewer rounds)
        self.owner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lockstep-engine")
        self.labels: set[str] = set()             # what the runs' proxies say they are (must match the engine)
        self.failed: BaseException | None = None
        self.rounds = 0
        # evaluations at once: one per CPU this process may use (its affinity; in a Ray task, the CPUs Ray gave it)
        self.eval_slots = threading.BoundedSemaphore(cpus())

    def evaluating(self, evaluate: Callable[[torch.Tensor], tuple[float, float]]):
        """`evaluate`, run outside this run's turn: the other runs take theirs meanwhile (their evaluations, at
        most one per CPU at once, while the training workers wait for the round's last run)."""
        def unlocked(w: torch.Tensor) -> tuple[float, float]:
            self.cv.release()
            try:
                with self.eval_slots:
                    return evaluate(w)
            finally:
                self.cv.acquire()
        return unlocked

    def factory(self, rid: int, router: _Router):
        def make(model: torch.nn.Module, client_data: list[tuple[torch.Tensor, torch.Tensor]]) -> _Proxy:
            router.take()   # setup_run has just attached the run's log files
            return _Proxy(self, rid, model, client_data)
        return make

    def add_data(self, model: torch.nn.Module, client_data: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        """This run's first client in the shared data (runs with equal shards share them)."""
        if self.engine is not None:
            raise RuntimeError("lockstep: a run joined after training started")
        h = hashlib.blake2b(digest_size=16)
        for x, y in client_data:
            h.update(str((tuple(x.shape), x.dtype, tuple(y.shape), y.dtype)).encode())
            h.update(x.contiguous().numpy().tobytes())
            h.update(y.contiguous().numpy().tobytes())
        key = h.hexdigest()
        if key not in self.blocks:
            self.blocks[key] = len(self.data)
            self.data.extend(client_data)
        if self.model is None:
            self.model = model
        return self.blocks[key]

    def submit(self, rid: int, req: _Request) -> list[LocalResult]:
        """Called in the run's turn (self.cv held): wait until every live run has submitted, train, return."""
        self.pending[rid] = req
        self._maybe_train()
        while rid not in self.done:
            if self.failed is not None:
                raise RuntimeError(f"lockstep: another run's round failed ({self.failed!r})") from self.failed
            self.cv.wait()
        return self.done.pop(rid)

    def leave(self) -> None:
        """A run has finished (or failed): the others no longer wait for it."""
        self.live -= 1
        self._maybe_train()

    def _maybe_train(self) -> None:
        if not self.pending or len(self.pending) < self.live or self.failed is not None:
            return
        requests, self.pending = self.pending, {}
        try:
            self.done.update(self._train(requests))
        except BaseException as e:
            self.failed = e
            raise
        finally:
            self.cv.notify_all()

    def _train(self, requests: dict[int, _Request]) -> dict[int, list[LocalResult]]:
        tick = time.perf_counter()
        if self.engine is None:
            assert self.model is not None
            # the runs' --slices: the serial executor's engine cuts each run's round the same way
            self.engine = self.owner.submit(BatchedEngine, self.model, self.data, workers=self.workers,
                                            groups=self.slices, device="cpu").result()   # `why_not`: CPU runs
            if self.labels != {self.engine.describe()}:   # metrics.jsonl's `engine` must say what ran
                raise RuntimeError(f"lockstep: the runs expect {self.labels}, the engine is {self.engine.describe()}")
        rids = sorted(requests)
        ws = torch.stack([requests[r].w for r in rids])
        merged: dict[tuple, list[tuple[int, int, int]]] = {}   # key → (rid, task index, terms) of every merged task
        parts: list[tuple] = []                           # (w, tasks, data, start) as Group.train takes them
        owners: list[list[tuple[int, int]]] = []
        for r in rids:
            req = requests[r]
            at = {id(t): i for i, t in enumerate(req.tasks)}
            for s in self.engine.slices(req.tasks):   # the serial executor's slices of this run's round
                key = _key(s, req.merges, req.fused)
                if key is None:                       # trains alone, exactly as the serial slice
                    parts.append((req.w, s, [req.base + t.client for t in s], None))
                    owners.append([(r, at[id(t)]) for t in s])
                else:
                    merged.setdefault(key[0], []).extend((r, at[id(t)], key[1]) for t in s)
        digests = {r: _digest(requests[r].w) for r in rids} if merged else {}
        copies: list[tuple[tuple[int, int], tuple[int, int]]] = []   # (task, the identical task that trains)
        for members in merged.values():               # cut by count, independent of the worker count
            members = _unique(members, requests, digests, copies)
            g = min(self.engine.groups, len(members))
            bounds = [len(members) * i // g for i in range(g + 1)]
            for a, b in zip(bounds, bounds[1:]):
                chunk = members[a:b]
                tasks = [requests[r].tasks[i] for r, i, _ in chunk]
                fused = requests[chunk[0][0]].fused       # the same for every run of the group (one engine)
                terms = [m for _, _, m in chunk] if fused else None   # fused: each task's own slice's terms
                parts.append((ws, tasks, [requests[r].base + t.client for (r, _, _), t in zip(chunk, tasks)],
                              [rids.index(r) for r, _, _ in chunk], terms))
                owners.append([(r, i) for r, i, _ in chunk])
        out = {r: [None] * len(requests[r].tasks) for r in rids}
        for chunk, results in zip(owners, self.owner.submit(self.engine.run_parts, parts).result()):
            for (r, i), res in zip(chunk, results):
                out[r][i] = res
        for (r, i), (r0, i0) in copies:   # a run's own copy: strategies keep and modify deltas
            res = out[r0][i0]
            out[r][i] = replace(res, delta=res.delta.clone())
        self.rounds += 1
        self.copied += len(copies)
        if self.progress is not None:
            n = sum(len(requests[r].tasks) for r in rids)
            once = f" ({len(copies)} identical to another run's, trained once)" if copies else ""
            self.progress(f"lockstep step {self.rounds}: {len(rids)} runs, {n} clients{once} in {len(parts)} "
                          f"computations, {time.perf_counter() - tick:.1f} s")
        return out  # type: ignore[return-value]

    def close(self) -> None:
        if self.engine is not None:
            self.owner.submit(self.engine.close).result()
        self.owner.shutdown()


class _Proxy:
    """What a run's SimTransport takes for its batched engine: the run's side of the lockstep group."""

    def __init__(self, lockstep: Lockstep, rid: int, model: torch.nn.Module,
                 client_data: list[tuple[torch.Tensor, torch.Tensor]]):
        self.lockstep, self.rid = lockstep, rid
        self.base = lockstep.add_data(model, client_data)
        # what the serial executor's engine would run for this run (the same decision, on the same inputs)
        x0 = next((x for x, _ in client_data if len(x)), client_data[0][0])
        probe = Group(model, x0[:1], torch.zeros(1, dtype=torch.long), [0], [1])
        self.native, self.device = probe.native, probe.device
        self.merges = _merges(model, probe)
        self.fused = probe.native is not None and fused_update(probe.native, probe.x_all.dtype)
        lockstep.labels.add(self.describe())

    def describe(self) -> str:
        return BatchedEngine.describe(self)  # type: ignore[arg-type]  (reads .native and .device)

    def details(self) -> dict:
        return {"device": str(self.device), "workers": self.lockstep.workers or 0, "native": bool(self.native),
                "kernel": self.native, "lockstep": True, "merged": self.merges}

    def run(self, w: torch.Tensor, tasks: list[TrainTask]) -> list[LocalResult]:
        return self.lockstep.submit(self.rid, _Request(w, tasks, self.base, self.merges, self.fused))

    def close(self) -> None:
        """The shared engine outlives each run; the group closes it."""


def run_group(jobs: list, progress: bool, say: Callable[[str], None], workers: int | None = None) -> None:
    """Run `jobs` (coordinator/sim/sweep.Job, one lockstep group) to the end; raise the first job's error
    after the others have finished (a failing run does not stop the others)."""
    from coordinator.sim.run import run_sim

    group = Lockstep(len(jobs), workers, say if progress else None, getattr(jobs[0].cfg.train, "slices", 2))
    router = _Router()
    root = logging.getLogger(logs.ROOT)
    root.addHandler(router)
    errors: dict[int, BaseException] = {}

    def body(rid: int) -> None:
        job = jobs[rid]
        with group.cv:   # this run's turn (given up only while it waits in Lockstep.submit)
            try:
                run_sim(job.cfg, str(job.out), resume=job.resume, progress=False, overwrite=job.overwrite,
                        make_engine=group.factory(rid, router), wrap_evaluate=group.evaluating)
                say(f"lockstep: {job.label or job.out} done")
            except BaseException as e:  # noqa: BLE001 (reported below, after the other runs)
                errors[rid] = e
                say(f"lockstep: {job.label or job.out} failed: {e}")
            finally:
                try:
                    group.leave()
                except BaseException as e:  # noqa: BLE001 (the training of the others' round failed)
                    errors.setdefault(rid, e)

    threads = [threading.Thread(target=body, args=(i,), name=f"lockstep-{i}", daemon=True) for i in range(len(jobs))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.5)   # a join with a timeout lets Ctrl-C through
    finally:
        root.removeHandler(router)
        router.close()
    # after all runs (on Ctrl-C the runs' threads and the engine's workers end with this process;
    # every run directory holds its last checkpoint, so --resume continues it)
    group.close()
    if group.copied:
        say(f"lockstep: {group.copied} tasks were identical to another run's task of the same round (same start "
            "weights, data and task) and trained once, their results copied")
    if errors:   # the first run's error; a divergence only if nothing else failed (it can be a result: sweep.py)
        others = {r: e for r, e in errors.items() if not isinstance(e, FloatingPointError)} or errors
        raise others[min(others)]
