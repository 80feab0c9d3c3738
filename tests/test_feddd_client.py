"""FedDD client side: Algorithm 2 masks worked by hand, eq. (21), the sparse encoding, eq. (5)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from edge_client import feddd
from edge_client.models import build_model, get_flat
from edge_client.trainer import TrainTask


def tiny() -> nn.Module:
    """Linear(2→3) + Linear(3→2): flat layout w0 [0:6] (rows of 2), b0 [6:9], w1 [9:15] (rows of 3), b1 [15:17]."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2))


def tiny_update() -> tuple[torch.Tensor, torch.Tensor]:
    """W = 1 everywhere, so eq. (20) per element is ΔW (1 + ΔW):
    layer 0: unit 0 Δw = [1, 0], Δb = 0 -> ‖[2, 0, 0]‖ = 2; unit 1: no change -> 0;
             unit 2 Δw = [0, 1], Δb = 1 -> ‖[0, 2, 2]‖ = √8;
    layer 1: unit 0 no change -> 0; unit 1 Δw = [−0.5, 0, 0] -> ‖[−0.25, 0, 0]‖ = 0.25."""
    w_old = torch.ones(17)
    d = torch.zeros(17)
    d[0], d[5], d[8], d[12] = 1.0, 1.0, 1.0, -0.5
    return w_old, w_old + d


def test_layout_of_tiny_model():
    lay = feddd.unit_layout(tiny())
    assert [(layer.units, layer.tensors) for layer in lay.layers] == [(3, ((0, 2), (6, 1))), (2, ((9, 3), (15, 1)))]
    assert lay.units == 5 and lay.numel == 17 and lay.always == ()


def test_importance_and_mask_hand_worked():
    lay = feddd.unit_layout(tiny())
    w_old, w_new = tiny_update()
    scores = feddd.importance(lay, w_old, w_new)
    np.testing.assert_allclose(scores[0], [2.0, 0.0, np.sqrt(8.0)])
    np.testing.assert_allclose(scores[1], [0.0, 0.25])
    # D = 0.5: layer 0 keeps round(1.5) = 2 units (2, then 0), layer 1 keeps round(1.0) = 1 (unit 1)
    masks = feddd.select_upload(lay, w_old, w_new, 0.5)
    assert [m.tolist() for m in masks] == [[True, False, True], [False, True]]
    flat = feddd.flat_mask(lay, masks)
    assert torch.nonzero(flat).flatten().tolist() == [0, 1, 4, 5, 6, 8, 12, 13, 14, 16]


def test_eq20_divides_by_the_old_weight():
    """W = [2, 0.5], Ŵ = [3, 1]: ΔW Ŵ / W = [1·3/2, 0.5·1/0.5] = [1.5, 1.0]: small old weights count more."""
    m = nn.Linear(1, 2, bias=False)
    lay = feddd.unit_layout(m)
    np.testing.assert_allclose(feddd.importance(lay, torch.tensor([2.0, 0.5]), torch.tensor([3.0, 1.0]))[0],
                               [1.5, 1.0])


def test_eq21_coverage_favours_rare_units():
    """Layer 0 keeps 1 unit at D = 2/3: by eq. (20) unit 2 (√8 > 2); with CR = [0.25, 1, 1] unit 0 (2/0.25 = 8)."""
    lay = feddd.unit_layout(tiny())
    w_old, w_new = tiny_update()
    plain = feddd.select_upload(lay, w_old, w_new, 2 / 3)
    rare = feddd.select_upload(lay, w_old, w_new, 2 / 3, coverage=[np.array([0.25, 1.0, 1.0]), np.ones(2)])
    assert plain[0].tolist() == [False, False, True]
    assert rare[0].tolist() == [True, False, False]


@pytest.mark.parametrize("units,d,kept", [(3, 0.5, 2), (10, 0.8, 2), (10, 0.0, 10), (10, 1.0, 0), (64, 0.6, 26)])
def test_keep_count_uses_one_minus_d(units, d, kept):
    assert feddd.keep_count(units, d) == kept


def test_label_score():
    assert feddd.label_score(torch.tensor([0, 0, 1, 1]), 4) == 2.0      # two of four classes at 1/2 each
    assert feddd.label_score(torch.tensor([0, 1, 2, 3]), 4) == 4.0      # uniform
    assert feddd.label_score(torch.tensor([3, 3, 3]), 4) == 1.0         # one class
    assert feddd.label_score(torch.tensor([0, 0, 0, 1]), 4) == 2.0      # min(3, 1) + min(1, 1)


def test_tiny_payload_bytes():
    lay = feddd.unit_layout(tiny())
    w_old, w_new = tiny_update()
    masks = feddd.select_upload(lay, w_old, w_new, 0.5)
    payload = feddd.encode_sparse(lay, masks, w_new)
    # 12-byte header + 1 bitmap byte (5 units) + 10 float32 values = 53 < 17·4 = 68
    assert len(payload) == feddd.sparse_nbytes(lay, masks) == 53 and feddd.dense_nbytes(lay) == 68


@pytest.mark.parametrize("name,shape", [("mlp", (1, 28, 28)), ("mimic-cnn", (1, 28, 28))])
def test_sparse_round_trip_and_size(name, shape):
    model = build_model(name, shape)
    lay = feddd.unit_layout(model)
    w_old = get_flat(model)
    w_new = w_old + 0.01 * torch.randn(lay.numel, generator=torch.Generator().manual_seed(3))
    sizes = []
    for d in (0.1, 0.3, 0.6, 0.8):
        masks = feddd.select_upload(lay, w_old, w_new, d)
        payload = feddd.encode_sparse(lay, masks, w_new)
        got_masks, keep, values = feddd.decode_sparse(lay, payload)
        assert [m.tolist() for m in got_masks] == [m.tolist() for m in masks]
        assert torch.equal(keep, feddd.flat_mask(lay, masks))
        assert torch.equal(values[keep], w_new[keep]) and not values[~keep].any()
        assert len(payload) == feddd.sparse_nbytes(lay, masks) < feddd.dense_nbytes(lay)
        sizes.append(len(payload))
    assert sizes == sorted(sizes, reverse=True)  # more dropout, fewer bytes


def test_decode_rejects_mismatched_payloads():
    lay = feddd.unit_layout(tiny())
    w_old, w_new = tiny_update()
    payload = feddd.encode_sparse(lay, feddd.select_upload(lay, w_old, w_new, 0.5), w_new)
    with pytest.raises(feddd.SparseError, match="does not match"):
        feddd.decode_sparse(lay, payload[:-4])
    with pytest.raises(feddd.SparseError, match="magic"):
        feddd.decode_sparse(lay, b"XXXX" + payload[4:])
    with pytest.raises(feddd.SparseError, match="units"):
        feddd.decode_sparse(feddd.unit_layout(nn.Linear(2, 4)), payload)


def test_merge_download_eq5():
    """W_n = W ⊙ M + Ŵ_n ⊙ (1 − M): layer-0 units 0 and 2, layer-1 unit 1 come from the global model."""
    lay = feddd.unit_layout(tiny())
    mem = feddd.Memory(round=3, w_local=torch.zeros(17), masks=[np.array([True, False, True]), np.array([False, True])])
    merged = feddd.merge_download(mem, lay, torch.ones(17))
    assert torch.nonzero(merged).flatten().tolist() == [0, 1, 4, 5, 6, 8, 12, 13, 14, 16]


def test_client_round_uploads_masked_delta_and_keeps_memory():
    model = tiny()
    lay = feddd.unit_layout(model)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 2, generator=g), torch.tensor([0, 1] * 4)
    w = get_flat(model)
    task = TrainTask(client=0, round=0, lr=0.5, batch_size=4, dropout_rate=0.5)
    w_before = w.clone()
    out, mem = feddd.client_round(model, lay, w, x, y, task, None)
    w_hat = get_flat(model)
    assert torch.equal(w, w_before)  # the global model is not trained in place
    assert out.mask.sum() == 10 and not out.sparse_download and out.download_bytes == 68
    assert (out.delta[out.mask] != 0).all()
    assert torch.equal(out.delta[out.mask], (w - w_hat)[out.mask]) and not out.delta[~out.mask].any()
    assert out.upload_bytes == 53 and mem.round == 0 and torch.equal(mem.w_local, w_hat)
    # next round, sparse download: starts from eq. (5) and pays for 10 values, not 17
    w2 = w - 0.1
    task2 = TrainTask(client=0, round=1, lr=0.0, batch_size=4, dropout_rate=0.5, sparse_download=True)
    out2, _ = feddd.client_round(model, lay, w2, x, y, task2, mem)
    start = torch.where(out.mask, w2, w_hat)
    assert out2.sparse_download and out2.download_bytes == 53
    assert torch.allclose(out2.delta[out2.mask], (w2 - start)[out2.mask])  # lr = 0: Ŵ = start


def test_edge_client_does_not_import_coordinator_or_cvxpy():
    import subprocess
    import sys
    code = ("import sys, edge_client.feddd, edge_client.trainer; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('coordinator', 'cvx', 'cvxpy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_upload_payload_gives_the_server_the_simulated_delta():
    """Field path (encode the kept values Ŵ, decode on the coordinator against W^t) = simulation path."""
    model = tiny()
    lay = feddd.unit_layout(model)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 2, generator=g), torch.tensor([0, 1] * 4)
    w = get_flat(model)
    out, mem = feddd.client_round(model, lay, w, x, y, TrainTask(client=0, round=0, lr=0.5, batch_size=4,
                                                                 dropout_rate=0.5), None)
    payload = feddd.encode_sparse(lay, mem.masks, mem.w_local)
    assert len(payload) == out.upload_bytes
    delta, mask = feddd.delta_from_upload(lay, payload, w)
    assert torch.equal(mask, out.mask) and torch.equal(delta, out.delta)
