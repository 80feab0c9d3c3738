"""A sweep's runs as Ray tasks on a cluster: `run_on_ray(jobs, address)` (the sweep executor "ray",
coordinator/sim/sweep.py; `dropfl reproduce --ray`).

Each job is one Ray task (1 CPU) that runs `run_sim` on whichever node Ray picks, into a temporary
directory of that node, and returns the finished run directory as bytes (a tar archive) through Ray's
object store; the driver unpacks it into the job's `out`. Nothing needs a shared filesystem: a resumed
job ships its run directory to the node the same way. What must be on every node: dropfl with the `ray`
extra (the same versions of dropfl, torch and Python: the same code gives the same bits), the dataset
files, and any file the config names (traces, clock profiles) at the same path; relative paths are
resolved from the driver's working directory where that directory exists on the node.

A run on Ray writes the very files it writes locally (model.pt, metrics except the timing fields
`seconds` and `elapsed`, participation: bitwise, tests/test_ray.py): the same `run_sim` on the same
config; `config.json` keeps the job's config as given (its `run.out` is not the temporary directory).

Every run directory is checked before anything is submitted (as `dropfl sim` checks its --out). A failing
run does not stop the others: they finish and are gathered, then the first failure (in job order) is raised.
Progress: one line per finished run (node, seconds) through `log`, and a tqdm bar on a terminal.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from coordinator.errors import UserError
from coordinator.scale import cluster_cpus, connected


def pack(path: Path) -> bytes:
    """`path`'s files as an uncompressed tar archive (run directories hold mostly float tensors, which do
    not compress; plain tar costs no CPU)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for p in sorted(path.iterdir()):
            tar.add(p, arcname=p.name)
    return buf.getvalue()


def unpack(data: bytes, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        tar.extractall(dest, filter="data")   # no absolute paths, links out of dest or devices


def run_job(cfg, resume: bool, packed: bytes | None, cwd: str) -> tuple[bytes, str, float]:
    """The Ray task: `run_sim` into a temporary directory of this node; (the run directory packed, this
    node's address, seconds). `packed`: the run directory to resume."""
    import ray

    from coordinator.sim.run import run_sim

    with tempfile.TemporaryDirectory(prefix="dropfl-ray-") as tmp:
        run = Path(tmp) / "run"
        if packed is not None:
            unpack(packed, run)
        start = time.perf_counter()
        with contextlib.chdir(cwd) if os.path.isdir(cwd) else contextlib.nullcontext():
            run_sim(cfg, str(run), resume=resume, progress=False)
        seconds = time.perf_counter() - start
        return pack(run), ray.util.get_node_ip_address(), seconds


def gather(data: bytes, out: Path) -> None:
    """Put a finished run directory, as `run_job` returned it, into `out`: unpacked beside it first, then
    the run files `out` held removed as --overwrite removes them (a resumed run comes back whole, so the
    same), then moved in. Anything else in `out` is left alone."""
    from coordinator.rundir import RunDir

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.ray-", dir=out.parent) as tmp:
        unpack(data, Path(tmp))
        RunDir(out, overwrite=True)   # removes exactly the run's files and directories, creates `out`
        for p in sorted(Path(tmp).iterdir()):
            if (out / p.name).is_dir():
                shutil.rmtree(out / p.name)
            os.replace(p, out / p.name)


def run_on_ray(jobs: list, address: str | None = None, progress: bool = True,
               log: Callable[[str], None] | None = None) -> list[Path]:
    """Run sweep `jobs` (coordinator.sim.sweep.Job) as Ray tasks on the cluster at `address` (see
    coordinator.scale.connected); return their run directories in the order of `jobs`."""
    from coordinator.rundir import check_out

    say = log or (lambda _line: None)
    for job in jobs:   # every run directory checked before anything runs or is written
        check_out(job.out, job.resume, job.overwrite)
    if not jobs:
        return []
    with connected(address) as ray:
        task = ray.remote(num_cpus=1)(run_job)
        nodes = len([n for n in ray.nodes() if n.get("Alive")])
        refs = {task.remote(job.cfg, job.resume, pack(Path(job.out)) if job.resume else None, os.getcwd()): k
                for k, job in enumerate(jobs)}
        say(f"ray: {len(jobs)} runs submitted to {nodes} node(s), {cluster_cpus(ray)} CPUs")
        failures: dict[int, BaseException] = {}
        bar = _bar(len(jobs)) if progress and sys.stderr.isatty() else None
        pending, done = list(refs), 0
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                k, done = refs[ready[0]], done + 1
                job = jobs[k]
                name = job.label or str(job.out)
                try:
                    data, node, seconds = ray.get(ready[0])
                except ray.exceptions.RayError as e:
                    failures[k] = _cause(e)
                    say(f"[{done}/{len(jobs)}] {name}: FAILED: {str(failures[k]).strip().splitlines()[0]}")
                else:
                    gather(data, Path(job.out))
                    say(f"[{done}/{len(jobs)}] {name}: {job.cfg.run.rounds} rounds on {node} in {seconds:.1f} s "
                        f"-> {job.out}")
                if bar is not None:
                    bar.update(1)
        except BaseException:   # Ctrl-C or a failed gather: nothing keeps running on the cluster
            for ref in pending:
                ray.cancel(ref, force=True)
            raise
        finally:
            if bar is not None:
                bar.close()
    if failures:
        raise failures[min(failures)]
    return [Path(job.out) for job in jobs]


def _cause(e: BaseException) -> BaseException:
    """The run's own exception where Ray kept it (a UserError stays a one-line UserError), else Ray's."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, UserError):
        return UserError(str(cause))
    return cause if isinstance(cause, BaseException) else e


def _bar(total: int):
    from tqdm import tqdm
    return tqdm(total=total, desc="sweep on ray", unit="run", dynamic_ncols=True)
