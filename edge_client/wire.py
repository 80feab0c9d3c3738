"""The dropfl wire format (docs/protocol.md): one framed message per MQTT payload.

    frame = b"DFL1" | u32 big-endian header length | header (UTF-8 JSON) | body (raw tensor bytes)

The header binds the body to a run, a round and a client, names its kind, dtype and shape, and
carries the sha256 of the whole tensor. A tensor larger than `chunk_bytes` is split into chunks,
one frame each (`chunk` / `chunks`, each with its own `chunk_sha256`); `Reassembler` puts them
back together and checks the whole tensor's sha256. Anything malformed, oversized, of another
schema version, or bound to another run or round raises `WireError` with a one-line reason and
never reaches aggregation.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

MAGIC = b"DFL1"
SCHEMA_VERSION = 1
KINDS = ("status", "heartbeat", "task", "model", "onnx", "update", "decline", "stats", "eval", "coordinator")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64, "int32": torch.int32,
          "uint8": torch.uint8, "bool": torch.bool}
_PREFIX = struct.Struct(">4sI")
MAX_DIMS = 32  # dimensions of a tensor's shape
_REQUIRED = {"v": int, "run": str, "round": int, "client": int, "kind": str, "nbytes": int, "sha256": str,
             "chunk": int, "chunks": int, "chunk_sha256": str, "meta": dict}


# Reject codes (WireError.code): the short reason a receiver counts rejects by (docs/protocol.md).
MALFORMED, VERSION, TOO_LARGE, CHECKSUM = "malformed", "version", "too_large", "checksum"
WRONG_RUN, WRONG_ROUND, WRONG_CLIENT, WRONG_KIND = "run", "round", "client", "kind"


class WireError(ValueError):
    """A message was rejected; `reason` says why in one line, `code` is its short category."""

    def __init__(self, reason: str, code: str = MALFORMED):
        super().__init__(reason)
        self.reason = reason
        self.code = code


@dataclass(frozen=True)
class Limits:
    chunk_bytes: int = 256 * 1024          # tensors above this are sent in chunks of this size
    max_tensor_bytes: int = 256 * 1024 ** 2  # a tensor may not be larger than this (after reassembly)
    max_header_bytes: int = 64 * 1024
    max_pending: int = 1024                # partial messages kept by a Reassembler at once
    max_pending_per_client: int = 8        # ... of which at most this many with one client index

    def __post_init__(self):
        if self.chunk_bytes < 1 or self.max_tensor_bytes < 0 or self.max_header_bytes < 64 or \
                self.max_pending_per_client < 1:
            raise ValueError(f"wire limits out of range: {self}")


@dataclass
class Header:
    v: int
    run: str
    round: int
    client: int
    kind: str
    nbytes: int                # bytes of the whole tensor (0: no tensor)
    sha256: str                # of the whole tensor's bytes
    chunk: int                 # 0-based index of this frame's chunk
    chunks: int                # number of chunks of the tensor (1 if not chunked)
    chunk_sha256: str          # of this frame's body
    meta: dict[str, Any] = field(default_factory=dict)
    dtype: str | None = None
    shape: list[int] | None = None
    sent_at: float = 0.0       # sender's wall clock (time.time()) when the message was encoded


@dataclass
class Message:
    header: Header
    tensor: torch.Tensor | None

    @property
    def kind(self) -> str:
        return self.header.kind

    @property
    def meta(self) -> dict[str, Any]:
        return self.header.meta


def _sha(b: bytes | memoryview) -> str:
    return hashlib.sha256(b).hexdigest()


DIGEST_HEX = 16  # hex digits of a model digest


def model_digest(w: torch.Tensor) -> str:
    """The digest that binds an update to the global model it was trained on (docs/protocol.md): the first
    16 hex digits of the sha256 of the weights' float32 little-endian bytes. Both sides compute it from the
    same bytes (the coordinator from its flat global weights, the agent from the model message's tensor)."""
    return _sha(tensor_bytes(w.detach().to(torch.float32).reshape(-1))[2])[:DIGEST_HEX]


def tensor_bytes(t: torch.Tensor) -> tuple[str, list[int], bytes]:
    """(dtype name, shape, little-endian C-order bytes) of a CPU tensor."""
    names = {v: k for k, v in DTYPES.items()}
    if t.dtype not in names:
        raise WireError(f"dtype {t.dtype} cannot be sent (allowed: {', '.join(DTYPES)})")
    arr = t.detach().cpu().contiguous().numpy()
    if arr.dtype.byteorder == ">":
        arr = arr.byteswap().view(arr.dtype.newbyteorder("<"))
    return names[t.dtype], list(t.shape), arr.tobytes()


def buffers_meta(buffers: dict[str, torch.Tensor]) -> dict[str, list]:
    """A model's buffers (BatchNorm's running statistics) as a message's meta field `buffers`: name → [dtype, shape,
    values] (JSON numbers: float32 and int64 values come back exactly). The model message carries the global
    buffers, an update its client's after training (docs/protocol.md)."""
    names = {v: k for k, v in DTYPES.items()}
    out = {}
    for n, b in buffers.items():
        if b.dtype not in names:
            raise WireError(f"buffer {n}: dtype {b.dtype} cannot be sent (allowed: {', '.join(DTYPES)})")
        out[n] = [names[b.dtype], list(b.shape), b.detach().cpu().reshape(-1).tolist()]
    return out


def meta_buffers(value: Any, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`buffers_meta`'s field back as tensors; WireError unless it holds exactly `like`'s names, dtypes and shapes."""
    names = {v: k for k, v in DTYPES.items()}
    if not isinstance(value, dict) or set(value) != set(like):
        raise WireError(f"buffers: expected {sorted(like)}")
    out = {}
    for n, ref in like.items():
        item = value[n]
        if not (isinstance(item, list) and len(item) == 3 and item[0] == names.get(ref.dtype)
                and item[1] == list(ref.shape) and isinstance(item[2], list) and len(item[2]) == ref.numel()):
            raise WireError(f"buffer {n}: expected {names.get(ref.dtype)} {list(ref.shape)}")
        try:
            out[n] = torch.tensor(item[2], dtype=ref.dtype).reshape(ref.shape)
        except (TypeError, ValueError, RuntimeError) as e:
            raise WireError(f"buffer {n}: {e}") from None
    return out


def encode(kind: str, run: str, round: int, client: int, tensor: torch.Tensor | None = None,
           meta: dict[str, Any] | None = None, limits: Limits = Limits()) -> list[bytes]:
    """Frames (MQTT payloads) of one message; more than one only when the tensor exceeds chunk_bytes."""
    if kind not in KINDS:
        raise WireError(f"unknown kind {kind!r}")
    dtype, shape, body = (None, None, b"") if tensor is None else tensor_bytes(tensor)
    if len(body) > limits.max_tensor_bytes:
        raise WireError(f"tensor of {len(body)} bytes exceeds the limit of {limits.max_tensor_bytes}")
    pieces = [body[i:i + limits.chunk_bytes] for i in range(0, len(body), limits.chunk_bytes)] or [b""]
    whole, sent_at = _sha(body), time.time()
    frames = []
    for i, piece in enumerate(pieces):
        h = {"v": SCHEMA_VERSION, "run": run, "round": int(round), "client": int(client), "kind": kind,
             "dtype": dtype, "shape": shape, "nbytes": len(body), "sha256": whole, "chunk": i,
             "chunks": len(pieces), "chunk_sha256": _sha(piece), "meta": meta or {}, "sent_at": sent_at}
        hb = json.dumps(h, separators=(",", ":")).encode()
        if len(hb) > limits.max_header_bytes:
            raise WireError(f"header of {len(hb)} bytes exceeds the limit of {limits.max_header_bytes}")
        frames.append(_PREFIX.pack(MAGIC, len(hb)) + hb + piece)
    return frames


def decode_frame(data: bytes, limits: Limits = Limits()) -> tuple[Header, bytes]:
    """Parse and check one frame: magic, header schema and bounds, chunk checksum."""
    if len(data) < _PREFIX.size:
        raise WireError(f"frame of {len(data)} bytes is shorter than the {_PREFIX.size}-byte prefix")
    magic, hlen = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r} (expected {MAGIC!r}): not a dropfl message")
    if hlen > limits.max_header_bytes or _PREFIX.size + hlen > len(data):
        raise WireError(f"header length {hlen} is out of bounds (frame {len(data)} bytes, "
                        f"limit {limits.max_header_bytes})", TOO_LARGE if hlen > limits.max_header_bytes else MALFORMED)
    try:
        raw = json.loads(data[_PREFIX.size:_PREFIX.size + hlen].decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: also ints of > 4300 digits
        raise WireError(f"header is not UTF-8 JSON ({str(e)[:200]})") from None
    if not isinstance(raw, dict):
        raise WireError("header is not a JSON object")
    if raw.get("v") != SCHEMA_VERSION:
        raise WireError(f"schema version {repr(raw.get('v'))[:20]} is not supported "
                        f"(this side speaks {SCHEMA_VERSION})", VERSION)
    for k, typ in _REQUIRED.items():
        if not isinstance(raw.get(k), typ) or isinstance(raw.get(k), bool) and typ is int:
            raise WireError(f"header field {k!r} is missing or not a {typ.__name__}")
    unknown = set(raw) - set(Header.__dataclass_fields__)
    if unknown:
        raise WireError(f"header has unknown fields {sorted(unknown)}")
    sent_at = raw.get("sent_at", 0.0)
    if not isinstance(sent_at, int | float) or isinstance(sent_at, bool) or not math.isfinite(sent_at):
        raise WireError("header field 'sent_at' is not a finite number")
    h = Header(**raw)
    body = data[_PREFIX.size + hlen:]
    if h.kind not in KINDS:
        raise WireError(f"unknown kind {h.kind[:40]!r}")
    if h.nbytes < 0:
        raise WireError(f"negative tensor size {h.nbytes}")
    if h.nbytes > limits.max_tensor_bytes:
        raise WireError(f"tensor of {h.nbytes} bytes exceeds the limit of {limits.max_tensor_bytes}", TOO_LARGE)
    if not (1 <= h.chunks <= max(1, h.nbytes) and 0 <= h.chunk < h.chunks):
        raise WireError(f"chunk {h.chunk} of {h.chunks} is out of range for {h.nbytes} bytes")
    if h.nbytes:
        if not isinstance(h.dtype, str) or h.dtype not in DTYPES:
            raise WireError(f"dtype {str(h.dtype)[:40]!r} is not allowed (allowed: {', '.join(DTYPES)})")
        if not isinstance(h.shape, list) or len(h.shape) > MAX_DIMS or \
                not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in h.shape):
            raise WireError(f"shape {str(h.shape)[:80]} is not a list of at most {MAX_DIMS} non-negative integers")
        itemsize = torch.empty((), dtype=DTYPES[h.dtype]).element_size()
        if math.prod(h.shape) * itemsize != h.nbytes:  # Python ints: no int64 wrap-around
            raise WireError(f"shape {h.shape} of {h.dtype} does not hold {h.nbytes} bytes")
    if len(body) > h.nbytes:
        raise WireError(f"chunk body of {len(body)} bytes is larger than the tensor ({h.nbytes} bytes)")
    if _sha(body) != h.chunk_sha256:
        raise WireError(f"checksum mismatch in chunk {h.chunk}/{h.chunks} (corrupted in transit)", CHECKSUM)
    return h, body


def check_binding(h: Header, run: str | None = None, round: int | None = None, client: int | None = None,
                  kinds: tuple[str, ...] | None = None) -> None:
    """Reject a message bound to another run, round or client, or of an unexpected kind."""
    if run is not None and h.run != run:
        raise WireError(f"wrong run id {h.run[:80]!r} (expected {run!r})", WRONG_RUN)
    if round is not None and h.round != round:
        raise WireError(f"wrong round {h.round} (expected {round})", WRONG_ROUND)
    if client is not None and h.client != client:
        raise WireError(f"wrong client {h.client} (expected {client})", WRONG_CLIENT)
    if kinds is not None and h.kind not in kinds:
        raise WireError(f"unexpected kind {h.kind!r} here (expected {' or '.join(kinds)})", WRONG_KIND)


def _assemble(h: Header, body: bytes) -> Message:
    if len(body) != h.nbytes:
        raise WireError(f"reassembled {len(body)} bytes, header says {h.nbytes}")
    if _sha(body) != h.sha256:
        raise WireError("checksum mismatch of the reassembled tensor", CHECKSUM)
    if not h.nbytes:
        return Message(h, None)
    arr = np.frombuffer(body, dtype=np.dtype(h.dtype).newbyteorder("<")).astype(np.dtype(h.dtype), copy=True)
    return Message(h, torch.from_numpy(arr).reshape(h.shape))


class Reassembler:
    """Collects frames into messages. `add` returns the complete message or None (chunk kept, or a
    duplicate of a chunk already held); raises WireError for a bad frame or an inconsistent chunk."""

    def __init__(self, limits: Limits = Limits()):
        self.limits = limits
        self.pending: OrderedDict[tuple, tuple[Header, dict[int, bytes]]] = OrderedDict()
        self.last: Header | None = None  # the header of the last frame `add` accepted (upload progress)

    def add(self, data: bytes, run: str | None = None, round: int | None = None,
            client: int | None = None, kinds: tuple[str, ...] | None = None,
            max_nbytes: int | None = None) -> Message | None:
        """`max_nbytes`: reject a larger tensor at its first frame, before any chunk of it is kept."""
        h, body = decode_frame(data, self.limits)
        check_binding(h, run, round, client, kinds)
        if max_nbytes is not None and h.nbytes > max_nbytes:
            raise WireError(f"tensor of {h.nbytes} bytes exceeds the {max_nbytes} bytes expected here", TOO_LARGE)
        self.last = h
        if h.chunks == 1:
            return _assemble(h, body)
        key = (h.run, h.round, h.client, h.kind, h.sha256)
        if key not in self.pending:
            mine = [k for k in self.pending if k[2] == h.client]
            if len(mine) >= self.limits.max_pending_per_client:  # one device cannot fill the buffer
                del self.pending[mine[0]]                         # its oldest partial message goes
            self.pending[key] = (h, {})
            while len(self.pending) > self.limits.max_pending:
                self.pending.popitem(last=False)
        first, parts = self.pending[key]
        if (h.nbytes, h.chunks, h.dtype, h.shape) != (first.nbytes, first.chunks, first.dtype, first.shape):
            raise WireError(f"chunk {h.chunk}/{h.chunks} disagrees with the first chunk's header")
        if h.chunk not in parts and sum(map(len, parts.values())) + len(body) > h.nbytes:
            del self.pending[key]  # chunks that add up to more than the tensor: never buffer past nbytes
            raise WireError(f"chunks of a {h.nbytes}-byte tensor hold more than {h.nbytes} bytes")
        parts.setdefault(h.chunk, body)
        if len(parts) < h.chunks:
            return None
        del self.pending[key]
        return _assemble(first, b"".join(parts[i] for i in range(h.chunks)))

    def drop(self, run: str | None = None, before_round: int | None = None) -> int:
        """Forget partial messages of another run or of rounds before `before_round`; returns how many."""
        stale = [k for k in self.pending
                 if (run is not None and k[0] != run) or (before_round is not None and k[1] < before_round)]
        for k in stale:
            del self.pending[k]
        return len(stale)


def decode(frames: list[bytes], limits: Limits = Limits(), **binding) -> Message:
    """Decode a complete message from its frames (any order)."""
    r = Reassembler(limits)
    out = None
    for f in frames:
        out = r.add(f, **binding) or out
    if out is None:
        raise WireError(f"incomplete message: {len(frames)} frame(s) do not complete it")
    return out
