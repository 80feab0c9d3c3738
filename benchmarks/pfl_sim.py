"""pfl-research's simulation (Apple's `pfl` 0.6, PyTorch) on a workload of benchmarks/sim_throughput.py; run by it
with the Python of benchmarks/.venv-pfl (created by benchmarks/setup_pfl.sh; pfl is never a dropfl dependency).

The workload's model (benchmarks/workloads.py: the same layers as dropfl's, with `nn.Dropout`) in pfl's
`PyTorchModel`, with the loss of pfl's image-classification benchmark (`image_classification_loss`: mean
cross-entropy); pfl's `FederatedAveraging` on a `SimulatedBackend` (one process, `--threads` torch threads, as
pfl's benchmark runs without Horovod); central optimizer SGD with lr 1.0 (the plain average of the updates, as in
pfl's CIFAR-10 baseline), `WeightByUser`; `--per-round` users sampled per round from a `FederatedDataset`
(`random` user sampler); each user trains `--steps` local steps of batch `--batch` with SGD at `--lr`
(`NNTrainHyperParams.local_num_steps`). No evaluation. Each central iteration is timed from the end of the
previous one (training starts at `on_train_begin`) by a callback; the first is reported apart (start-up).

    .venv-pfl/bin/python pfl_sim.py --data DIR --workload pfl-cifar10 --steps 5 --batch 10 --lr 0.1 \\
        --per-round 50 --rounds 3 --out pfl.json

DIR holds client_<i>.pt = {"x": float32 [n, *shape], "y": int64 [n]}, one file per user (memory-mapped).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from pfl.aggregate.simulate import SimulatedBackend
from pfl.aggregate.weighting import WeightByUser
from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
from pfl.callback.base import TrainingProcessCallback
from pfl.data.federated_dataset import FederatedDataset
from pfl.data.sampling import get_user_sampler
from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
from pfl.metrics import Metrics, Weighted
from pfl.model.pytorch import PyTorchModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import WORKLOADS, build  # noqa: E402


def loss(self, inputs, targets, eval=False):
    """pfl's benchmarks/model/pytorch/metrics.py `image_classification_loss`."""
    self.eval() if eval else self.train()
    return F.cross_entropy(self(inputs), targets.long())


@torch.no_grad()
def metrics(self, inputs, targets, eval=True):
    """pfl's `image_classification_metrics` (not called: no evaluation)."""
    self.eval() if eval else self.train()
    logits = self(inputs)
    n = len(inputs)
    return {"loss": Weighted(F.cross_entropy(logits, targets.long(), reduction="sum").item(), n),
            "accuracy": Weighted((logits.argmax(-1) == targets).float().sum().item(), n)}


class RoundTimer(TrainingProcessCallback):
    """Seconds of each central iteration, from the end of the previous one (or the start of training)."""

    def __init__(self) -> None:
        self.rounds: list[dict] = []
        self.last = 0.0

    def on_train_begin(self, *, model):
        self.last = time.perf_counter()
        return Metrics()

    def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
        now = time.perf_counter()
        self.rounds.append({"round": central_iteration + 1, "seconds": now - self.last})
        self.last = now
        return False, Metrics()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--workload", default="mimic-fmnist", choices=list(WORKLOADS))
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--per-round", type=int, default=0, help="users sampled per round (0: all)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    np.random.seed(0)
    torch.manual_seed(0)
    files = sorted((f for f in os.listdir(args.data) if f.startswith("client_")), key=lambda f: int(f[7:-3]))
    users = {}
    for f in files:
        d = torch.load(os.path.join(args.data, f), mmap=True)
        users[int(f[7:-3])] = [d["x"], d["y"]]
    k = args.per_round or len(users)
    fed = FederatedDataset.from_slices(users, get_user_sampler("random", list(users)))

    net = build(args.workload)
    net.loss, net.metrics = loss.__get__(net), metrics.__get__(net)
    model = PyTorchModel(model=net, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD([p for p in net.parameters() if p.requires_grad], 1.0))
    timer = RoundTimer()
    start = time.perf_counter()
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=args.rounds, evaluation_frequency=args.rounds + 1,
                                           train_cohort_size=k, val_cohort_size=0),
        backend=SimulatedBackend(training_data=fed, val_data=None, postprocessors=[WeightByUser()]),
        model=model,
        model_train_params=NNTrainHyperParams(local_learning_rate=args.lr, local_num_epochs=None,
                                              local_batch_size=args.batch, local_num_steps=args.steps),
        model_eval_params=NNEvalHyperParams(local_batch_size=1000),
        callbacks=[timer])
    total = time.perf_counter() - start
    later = [r["seconds"] for r in timer.rounds[1:]] or [r["seconds"] for r in timer.rounds]
    steps_per_s = [k * args.steps / s for s in later]
    import pfl
    with open(args.out, "w") as f:
        json.dump({"workload": args.workload, "clients": len(users), "clients_per_round": k, "batch": args.batch,
                   "steps": args.steps, "threads": args.threads, "pfl": getattr(pfl, "__version__", "?"),
                   "torch": torch.__version__, "rounds": timer.rounds, "total_seconds": total,
                   "client_steps_per_s": float(np.median(steps_per_s)), "per_round": steps_per_s}, f, indent=1)


if __name__ == "__main__":
    main()
