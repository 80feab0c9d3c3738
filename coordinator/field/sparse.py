"""Coordinator side of FedDD's sparse uploads over MQTT (docs/protocol.md, docs/feddd.md).

An `update` whose `meta.encoding` is `feddd-sparse-1` carries, as a uint8 tensor, the payload of
`edge_client.feddd.encode_sparse`: the unit bitmap and the client's kept values Ŵ. `sparse_problem`
validates it on arrival (before it can reach aggregation); `update_tensors` turns any valid update
into the (delta, mask) of a `ClientUpdate`, with `delta_from_upload` for sparse ones.
"""

from __future__ import annotations

import torch

from edge_client import feddd, wire


def is_sparse(m: wire.Message) -> bool:
    return m.meta.get("encoding") is not None


def sparse_problem(layout: feddd.Layout | None, m: wire.Message) -> str | None:
    """Why a sparse update must be rejected, or None if it is valid for this model."""
    enc = m.meta.get("encoding")
    if enc != feddd.WIRE_ENCODING:
        return f"unknown update encoding {enc!r} (this coordinator reads {feddd.WIRE_ENCODING!r})"
    if layout is None:
        return "a sparse update arrived but this coordinator has no model layout to decode it"
    t = m.tensor
    if t is None or t.dtype != torch.uint8 or t.dim() != 1:
        return f"a sparse update must be a 1-D uint8 tensor, got {m.header.dtype} {m.header.shape}"
    try:
        _, _, values = feddd.decode_sparse(layout, t.numpy().tobytes())
    except feddd.SparseError as e:
        return f"sparse payload: {e}"
    if not torch.isfinite(values).all():
        return "the sparse update holds NaN or infinite values"
    rate = m.meta.get("dropout_rate")
    if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0.0 <= rate <= 1.0:
        return f"meta dropout_rate {rate!r} is not a number in [0, 1]"
    return None


def update_tensors(layout: feddd.Layout | None, m: wire.Message, w: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(delta = w − w_local on the uploaded coordinates, mask or None = all) of a validated update."""
    if not is_sparse(m):
        return m.tensor, None
    if layout is None:
        raise ValueError("a sparse update needs the model layout (sparse_problem rejects it without one)")
    return feddd.delta_from_upload(layout, m.tensor.numpy().tobytes(), w)
