"""The coordinator's checks of what an agent sends beyond the wire format (docs/protocol.md, "Validation").

`edge_client.wire` rejects malformed frames, other schema versions, bad checksums, oversized tensors
and messages bound to another run, round or client, each with a `WireError.code`. This module adds
what only the coordinator knows: the model's size, dtype and shape, finite values, and the types and
ranges of the meta fields it reads (a string where a number belongs must be a reject, not a crash in
the round loop). Every check returns None or `(code, reason)`; the hub logs the reason, counts the
code and never aggregates the message.
"""

from __future__ import annotations

import math
import re

import torch

from coordinator.field import telemetry
from edge_client import wire

# Reject codes added here; the wire's own are wire.MALFORMED, VERSION, TOO_LARGE, CHECKSUM, WRONG_RUN,
# WRONG_ROUND, WRONG_CLIENT, WRONG_KIND.
SHAPE, NONFINITE, META, PAYLOAD, DEVICE = "shape", "nonfinite", "meta", "payload", "device"
MODEL = "model"  # an update trained on another global model than the round's (its model_digest differs)
MAX_STEPS = 10 ** 9
MAX_SAMPLES = 2 ** 31 - 1

Reject = tuple[str, str]

# optional numbers an update's meta may carry: None or finite and >= 0
_UPDATE_NUMBERS = ("train_s", "download_s", "download_span_s", "wait_s", "train_samples_per_s", "label_score")
_STATS_NUMBERS = ("upload_s", "upload_bytes", "uplink_Bps")
TRAIN_DEVICE_RE = re.compile(r"^[a-z][a-z0-9_]{0,15}$")  # a torch device type: cpu, cuda, mps ...


def max_update_bytes(num_params: int) -> int:
    """Largest `update` tensor accepted, checked at its first frame so that nothing bigger is ever
    buffered: twice the dense float32 update plus 64 KiB (room for FedDD's sparse encoding)."""
    return 8 * num_params + 64 * 1024


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number_problem(meta: dict, key: str) -> str | None:
    v = meta.get(key)
    if v is None:
        return None
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
        return f"meta {key} = {str(v)[:40]!r} is not a finite non-negative number"
    return None


def update_meta(meta: dict, announced_samples: object) -> Reject | None:
    """num_samples (at most what the device announced), steps, loss and the timing fields."""
    n, steps, loss = meta.get("num_samples"), meta.get("steps"), meta.get("loss")
    most = min(announced_samples, MAX_SAMPLES) if _is_int(announced_samples) and announced_samples >= 0 \
        else MAX_SAMPLES
    if not _is_int(n) or not 0 <= n <= most:
        return META, f"meta num_samples = {str(n)[:40]!r} is not an integer in 0..{most} (what the device announced)"
    if not _is_int(steps) or not 0 <= steps <= MAX_STEPS:
        return META, f"meta steps = {str(steps)[:40]!r} is not an integer in 0..{MAX_STEPS}"
    if loss is not None and (not isinstance(loss, int | float) or isinstance(loss, bool) or not math.isfinite(loss)):
        return META, f"meta loss = {str(loss)[:40]!r} is neither null nor a finite number"
    for k in _UPDATE_NUMBERS:
        problem = _number_problem(meta, k)
        if problem:
            return META, problem
    digest = meta.get("model_digest")
    if digest is not None and (not isinstance(digest, str) or len(digest) > 64):
        return META, f"meta model_digest = {str(digest)[:40]!r} is not a hex string"
    device = meta.get("train_device")  # optional: where the agent trained (`cpu`, `cuda`; edge_client/agent/device.py)
    if device is not None and not (isinstance(device, str) and TRAIN_DEVICE_RE.match(device)):
        return META, f"meta train_device = {str(device)[:40]!r} is not a torch device type (1-16 of a-z0-9_)"
    return None


def stale_model(meta: dict, digest: str | None) -> Reject | None:
    """An update whose `model_digest` (the global model the agent trained on) is not the round's `digest`:
    trained on another model (a resumed coordinator's redone round, a cached or replayed update). An
    update without a digest, or a round without one, is not checked."""
    got = meta.get("model_digest")
    if digest is None or got is None or got == digest:
        return None
    return MODEL, f"trained on model {str(got)[:64]!r}, this round's model is {digest!r} (stale)"


def update(m: wire.Message, num_params: int, announced_samples: object) -> Reject | None:
    """A complete `update` message: its meta, and for a dense update (no meta `encoding`) a float32
    tensor of shape [num_params] with finite values. Sparse (FedDD) payloads are checked by the hub's
    `_invalid` (coordinator/field/sparse.py); their meta is checked here too."""
    problem = update_meta(m.meta, announced_samples)
    if problem:
        return problem
    if m.meta.get("encoding") is not None:
        return None
    t = m.tensor
    if t is None or t.dtype != torch.float32 or list(t.shape) != [num_params]:
        return SHAPE, (f"expected a float32 tensor of shape [{num_params}] (the model), "
                       f"got {m.header.dtype} {str(m.header.shape)[:80]}")
    if not torch.isfinite(t).all():
        return NONFINITE, f"the update holds {int((~torch.isfinite(t)).sum())} NaN or infinite values"
    return None


def stats(m: wire.Message) -> Reject | None:
    """`stats`: no tensor; upload_s, upload_bytes, uplink_Bps are null or finite non-negative numbers; an
    optional `telemetry` object as coordinator/field/telemetry.py checks it."""
    if m.tensor is not None:
        return SHAPE, "a stats message carries no tensor"
    for k in _STATS_NUMBERS:
        problem = _number_problem(m.meta, k)
        if problem:
            return META, problem
    problem = telemetry.check(m.meta)
    return (META, problem) if problem else None


def eval_meta(m: wire.Message) -> tuple[dict, Reject | None]:
    """`eval`: (the fields written to field.jsonl, problem). Only accuracy in [0, 1], samples and seconds
    are kept, so an agent cannot write other keys (such as `event`) into the log."""
    meta = m.meta
    acc, samples = meta.get("accuracy"), meta.get("samples")
    if m.tensor is not None:
        return {}, (SHAPE, "an eval message carries no tensor")
    if not isinstance(acc, int | float) or isinstance(acc, bool) or not 0.0 <= acc <= 1.0:
        return {}, (META, f"meta accuracy = {str(acc)[:40]!r} is not a number in [0, 1]")
    if not _is_int(samples) or not 0 <= samples <= MAX_SAMPLES:
        return {}, (META, f"meta samples = {str(samples)[:40]!r} is not a non-negative integer")
    problem = _number_problem(meta, "seconds")
    if problem:
        return {}, (META, problem)
    return {"accuracy": acc, "samples": samples, "seconds": meta.get("seconds")}, None


def status_device(m: wire.Message, topic_device: str) -> Reject | None:
    """A status message names its device (meta `device`); it must be the device of its topic, which on a
    provisioned broker is the authenticated username (the ACL lets a device publish only its own topics)."""
    named = m.meta.get("device")
    if named is not None and named != topic_device:
        return DEVICE, f"status names device {str(named)[:64]!r} on the topic of {topic_device!r}"
    return None
