"""Fuzzing the wire decoder and the coordinator's message handling with hypothesis.

Arbitrary bytes, and valid messages with bits flipped, truncated, or with header fields replaced by
arbitrary JSON values: the decoder either returns a message or raises `WireError` — never another
exception — and the coordinator's hub never raises and never accepts an update that is not a finite
float32 vector of the model's size. Derandomized and bounded (a few hundred examples per property),
so the file runs in seconds and fails the same way every time.
"""

from __future__ import annotations

import json
import struct

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_field_hub import make_hub

from coordinator.field import telemetry
from coordinator.field.collection import RoundState
from edge_client import wire
from edge_client.trainer import TrainTask

FUZZ = settings(max_examples=300, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SMALL = wire.Limits(chunk_bytes=8, max_header_bytes=4096, max_tensor_bytes=4096)
CODES = {wire.MALFORMED, wire.VERSION, wire.TOO_LARGE, wire.CHECKSUM, wire.WRONG_RUN, wire.WRONG_ROUND,
         wire.WRONG_CLIENT, wire.WRONG_KIND}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2 ** 70, max_value=2 ** 70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
HEADER_FIELDS = sorted(wire.Header.__dataclass_fields__)


def valid_frames(chunked: bool = False) -> list[bytes]:
    t = torch.arange(6, dtype=torch.float32)
    return wire.encode("update", "run-x", 2, 1, t, {"num_samples": 10, "steps": 2},
                       SMALL if chunked else wire.Limits())


def split(frame: bytes) -> tuple[dict, bytes]:
    (hlen,) = struct.unpack(">I", frame[4:8])
    return json.loads(frame[8:8 + hlen]), frame[8 + hlen:]


def join(header: dict, body: bytes) -> bytes:
    hb = json.dumps(header).encode()
    return b"DFL1" + struct.pack(">I", len(hb)) + hb + body


def decodes_or_rejects(data: bytes, limits: wire.Limits = wire.Limits()) -> wire.Message | None:
    """decode the frame as one message; None if rejected. Any exception other than WireError fails."""
    try:
        return wire.decode([data], limits)
    except wire.WireError as e:
        assert e.code in CODES and e.reason
        return None


@FUZZ
@given(st.binary(max_size=512))
def test_arbitrary_bytes(data):
    decodes_or_rejects(data)


@FUZZ
@given(st.binary(max_size=512))
def test_arbitrary_bytes_after_the_magic(data):
    decodes_or_rejects(b"DFL1" + data)
    decodes_or_rejects(b"DFL1" + struct.pack(">I", len(data)) + data)


@FUZZ
@given(st.lists(st.integers(min_value=0), min_size=1, max_size=8))
def test_bit_flips_are_rejected(positions):
    frame = bytearray(valid_frames()[0])
    for p in positions:
        frame[p % len(frame)] ^= 1 << (p // len(frame)) % 8
    m = decodes_or_rejects(bytes(frame))
    if m is not None:  # a flip that survives must have hit a byte the checksums do not cover
        assert bytes(frame) != valid_frames()[0]
        assert torch.equal(m.tensor, torch.arange(6, dtype=torch.float32))


@FUZZ
@given(st.integers(min_value=0))
def test_truncation_is_rejected(cut):
    frame = valid_frames()[0]
    assert decodes_or_rejects(frame[:cut % len(frame)]) is None


@FUZZ
@given(st.sampled_from(HEADER_FIELDS + ["extra"]), json_values, st.booleans())
def test_header_field_changes(key, value, drop):
    header, body = split(valid_frames()[0])
    if drop:
        header.pop(key, None)
    else:
        header[key] = value
    m = decodes_or_rejects(join(header, body))
    if m is not None:
        assert m.tensor is None or m.tensor.numel() * m.tensor.element_size() == m.header.nbytes


@FUZZ
@given(st.lists(st.tuples(st.integers(min_value=0, max_value=2), st.sampled_from(HEADER_FIELDS), json_values),
                max_size=4),
       st.permutations(range(3)))
def test_chunked_messages_with_changed_chunks(changes, order):
    frames = valid_frames(chunked=True)
    assert len(frames) == 3
    for i, key, value in changes:
        header, body = split(frames[i])
        header[key] = value
        frames[i] = join(header, body)
    r = wire.Reassembler(SMALL)
    for i in order:
        try:
            m = r.add(frames[i])
        except wire.WireError as e:
            assert e.code in CODES
            continue
        if m is not None and m.kind == "update" and m.header.sha256 == split(valid_frames(True)[0])[0]["sha256"]:
            assert torch.equal(m.tensor.reshape(-1).to(torch.float32), torch.arange(6, dtype=torch.float32))
    assert sum(sum(map(len, parts.values())) for _, parts in r.pending.values()) <= SMALL.max_tensor_bytes


def test_a_shape_whose_int64_product_wraps_around_is_rejected():
    """3 * 0x5555555555555556 = 2 mod 2**64: with int64 arithmetic this shape "holds" 8 bytes of float32."""
    header, _ = split(valid_frames()[0])
    body = bytes(8)
    header |= {"shape": [3, 0x5555555555555556], "nbytes": 8, "sha256": wire._sha(body),
               "chunk_sha256": wire._sha(body)}
    try:
        wire.decode([join(header, body)])
    except wire.WireError as e:
        assert "does not hold 8 bytes" in e.reason
    else:
        raise AssertionError("accepted a shape of 2**64 + 2 elements")


@FUZZ
@given(st.sampled_from(["update/delta", "update/stats", "update/decline", "update/eval", "status", "heartbeat"]),
       st.sampled_from(["update", "stats", "decline", "eval", "status", "heartbeat"]),
       st.dictionaries(st.sampled_from(["num_samples", "steps", "loss", "train_s", "download_s", "wait_s",
                                        "upload_s", "uplink_Bps", "accuracy", "samples", "seconds", "state",
                                        "device", "reason", "available", "encoding", "event", "telemetry"]),
                       json_values, max_size=6),
       st.sampled_from([None, [4], [2, 2], [5]]),
       st.booleans(), st.integers(min_value=0, max_value=3))
def test_hub_never_raises_and_aggregates_only_valid_updates(tmp_path_factory, sub, kind, meta, shape, nan, client):
    hub = make_hub(tmp_path_factory.mktemp("hub"))  # model of 4 parameters; devices d0..d4 = clients 0..4
    r = hub.collection.round = RoundState(
        2, {c: TrainTask(client=c, round=2, lr=0.1, batch_size=4) for c in range(4)}, 0.0)
    tensor = None if shape is None else torch.ones(shape)
    if tensor is not None and nan:
        tensor.view(-1)[0] = float("nan")
    for f in wire.encode(kind, "run-x", 2, client, tensor, meta):
        hub._dispatch(f"d{client}", sub, f, False)
    for m in r.updates.values():
        assert m.tensor.dtype == torch.float32 and list(m.tensor.shape) == [4] and torch.isfinite(m.tensor).all()
        assert isinstance(m.meta["num_samples"], int) and isinstance(m.meta["steps"], int)
    for m in r.updates.values():  # what run_round and _log_round read: numbers or null
        assert all(m.meta.get(k) is None or isinstance(m.meta[k], int | float)
                   for k in ("loss", "train_s", "download_s", "wait_s", "train_samples_per_s"))
    for st_meta in r.stats.values():
        assert all(st_meta.get(k) is None or isinstance(st_meta[k], int | float)
                   for k in ("upload_s", "upload_bytes", "uplink_Bps"))
        assert telemetry.check(st_meta) is None  # what telemetry.jsonl gets: checked (coordinator/field/telemetry.py)
    assert "internal" not in hub.collection.rejects
