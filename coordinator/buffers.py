"""The global model's buffers (BatchNorm's running mean and variance, `num_batches_tracked`): the rule.

A model's state is its parameters (the flat vector every strategy aggregates, `edge_client.models.get_flat`) and its
buffers (`get_buffers`). Buffers are not part of a strategy's update vector: whatever the strategy, after each round

- each floating-point buffer is the mean of the participants' buffers (the clients whose update the round
  aggregated) weighted by their sample counts, Σ n_i·b_i / Σ n_i, summed in float64 in client order and cast back;
- each integer buffer (`num_batches_tracked`) is the participants' largest: a count of batches, not a statistic
  (a weighted mean of counts needs a rounding rule; the largest is exact and the count of the client that ran
  longest from the same starting count);
- a round with no participant (or whose participants hold no samples) keeps them.

Every client of a round starts training from the global buffers. Flower's FedAvg does the same with the whole
state_dict: `flwr/serverapp/strategy/strategy_utils.py:aggregate_arrayrecords` averages every array of the replies
(buffers included) with the weights num-examples / total (it averages `num_batches_tracked` too, as floats).
A model without buffers has {}: nothing here runs and no bit changes.
"""

from __future__ import annotations

import torch

from coordinator.strategies.base import ClientUpdate


def aggregate_buffers(current: dict[str, torch.Tensor], updates: dict[int, ClientUpdate]) -> dict[str, torch.Tensor]:
    """The global buffers after a round whose aggregated updates are `updates` (the rule above)."""
    got = [(u.num_samples, u.buffers) for _, u in sorted(updates.items()) if u.buffers is not None]
    total = sum(n for n, _ in got)
    if not current or total == 0:
        return current
    out = {}
    for name, b in current.items():
        if b.is_floating_point():
            acc = torch.zeros(b.shape, dtype=torch.float64)
            for n, bufs in got:
                acc += n * bufs[name].detach().to("cpu", torch.float64)
            out[name] = (acc / total).to(b.dtype)
        else:
            out[name] = torch.stack([bufs[name].detach().cpu() for _, bufs in got]).amax(0).to(b.dtype)
    return out
