"""Wire format: round trip, chunking, and every rejection path names its reason."""

import json
import struct

import pytest
import torch

from edge_client import wire
from edge_client.wire import Limits, Reassembler, WireError, decode, decode_frame, encode


def test_round_trip_keeps_tensor_bits_and_header():
    t = torch.randn(7, 3, generator=torch.Generator().manual_seed(0))
    frames = encode("update", "run-a", 4, 2, t, meta={"num_samples": 12, "loss": 0.5})
    assert len(frames) == 1
    m = decode(frames, run="run-a", round=4)
    assert m.kind == "update" and m.header.client == 2 and m.header.shape == [7, 3]
    assert m.meta == {"num_samples": 12, "loss": 0.5}
    assert torch.equal(m.tensor, t) and m.tensor.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.uint8, torch.bool])
def test_round_trip_other_dtypes(dtype):
    t = (torch.arange(10) % 3).to(dtype)
    assert torch.equal(decode(encode("onnx", "r", 0, 0, t)).tensor, t)


def test_header_only_message():
    m = decode(encode("decline", "r", 1, 3, meta={"reason": "battery"}))
    assert m.tensor is None and m.meta["reason"] == "battery"


def test_chunking_above_the_limit_and_reassembly_in_any_order():
    t = torch.arange(1000, dtype=torch.float32)  # 4000 bytes
    frames = encode("model", "r", 2, -1, t, limits=Limits(chunk_bytes=1024))
    assert len(frames) == 4
    r = Reassembler()
    assert r.add(frames[3]) is None and r.add(frames[0]) is None
    assert r.add(frames[0]) is None  # QoS 1 duplicate: ignored
    assert r.add(frames[2]) is None
    m = r.add(frames[1])
    assert torch.equal(m.tensor, t) and not r.pending


def test_incomplete_message_is_not_delivered():
    frames = encode("update", "r", 0, 1, torch.zeros(600), limits=Limits(chunk_bytes=1000))
    with pytest.raises(WireError, match="incomplete"):
        decode(frames[:-1])


def test_corrupted_chunk_checksum_is_rejected():
    frame = bytearray(encode("update", "r", 0, 1, torch.ones(16))[0])
    frame[-1] ^= 0xFF
    with pytest.raises(WireError, match="checksum mismatch"):
        decode_frame(bytes(frame))


def test_forged_whole_tensor_checksum_is_rejected():
    frame = encode("update", "r", 0, 1, torch.ones(4))[0]
    (hlen,) = struct.unpack(">I", frame[4:8])
    h = json.loads(frame[8:8 + hlen])
    h["sha256"] = "0" * 64
    hb = json.dumps(h).encode()
    with pytest.raises(WireError, match="reassembled tensor"):
        decode([b"DFL1" + struct.pack(">I", len(hb)) + hb + frame[8 + hlen:]])


@pytest.mark.parametrize("binding,match", [({"run": "other"}, "wrong run id"), ({"round": 5}, "wrong round"),
                                           ({"client": 9}, "wrong client"), ({"kinds": ("model",)}, "unexpected kind")])
def test_wrong_binding_is_rejected(binding, match):
    with pytest.raises(WireError, match=match):
        decode(encode("update", "run-a", 4, 2, torch.zeros(3)), **binding)


def _frame(header: dict, body: bytes = b"") -> bytes:
    hb = json.dumps(header).encode()
    return b"DFL1" + struct.pack(">I", len(hb)) + hb + body


def _good_header() -> dict:
    frame = encode("update", "r", 0, 0, torch.zeros(2))[0]
    (hlen,) = struct.unpack(">I", frame[4:8])
    return json.loads(frame[8:8 + hlen])


@pytest.mark.parametrize("data,match", [
    (b"DF", "shorter than"),
    (b"XXXX\x00\x00\x00\x02{}", "bad magic"),
    (b"DFL1\x00\x10\x00\x00{}", "out of bounds"),
    (b"DFL1\x00\x00\x00\x03{\xff}", "not UTF-8 JSON"),
    (b"DFL1\x00\x00\x00\x02[]", "not a JSON object"),
])
def test_malformed_frames_are_rejected(data, match):
    with pytest.raises(WireError, match=match):
        decode_frame(data)


@pytest.mark.parametrize("change,match", [
    ({"v": 2}, "schema version 2"),
    ({"round": "3"}, "'round' is missing"),
    ({"kind": "virus"}, "unknown kind"),
    ({"extra": 1}, "unknown fields"),
    ({"dtype": "float16"}, "dtype 'float16' is not allowed"),
    ({"shape": [3]}, "does not hold 8 bytes"),
    ({"chunk": 1}, "out of range"),
    ({"nbytes": 10 ** 12}, "exceeds the limit"),
])
def test_bad_headers_are_rejected(change, match):
    h = _good_header() | change
    with pytest.raises(WireError, match=match):
        decode_frame(_frame(h, bytes(8)))


def test_size_bound_on_encode_and_decode():
    small = Limits(max_tensor_bytes=100)
    with pytest.raises(WireError, match="exceeds the limit of 100"):
        encode("update", "r", 0, 0, torch.zeros(26), limits=small)
    with pytest.raises(WireError, match="exceeds the limit of 100"):
        decode_frame(encode("update", "r", 0, 0, torch.zeros(26))[0], small)


def test_inconsistent_chunks_are_rejected():
    a = encode("update", "r", 0, 0, torch.zeros(600), limits=Limits(chunk_bytes=1000))
    r = Reassembler()
    r.add(a[0])
    (hlen,) = struct.unpack(">I", a[1][4:8])
    h = json.loads(a[1][8:8 + hlen]) | {"shape": [300, 2]}
    with pytest.raises(WireError, match="disagrees"):
        r.add(_frame(h, a[1][8 + hlen:]))


def test_reassembler_bounds_pending_and_drops_stale_rounds():
    r = Reassembler(Limits(chunk_bytes=8, max_pending=2))
    for rnd in range(3):
        r.add(encode("update", "r", rnd, 0, torch.zeros(4), limits=Limits(chunk_bytes=8))[0])
    assert [k[1] for k in r.pending] == [1, 2]
    assert r.drop(before_round=2) == 1 and [k[1] for k in r.pending] == [2]


def test_dtype_not_on_the_list_cannot_be_sent():
    with pytest.raises(WireError, match="cannot be sent"):
        wire.encode("update", "r", 0, 0, torch.zeros(2, dtype=torch.float16))
