"""The wire format of docs/protocol.md: request headers, payload frames, replies."""

from __future__ import annotations

import math
from typing import Any, Iterable, List, Optional, Sequence, Tuple

import msgpack
import numpy as np

from .errors import ProtocolError

VERSION = 1

#: Defaults of the daemon's ``server.max_items_per_request`` / ``max_request_bytes``.
DEFAULT_MAX_ITEMS = 1024
DEFAULT_MAX_BYTES = 64 * 1024 * 1024

_DTYPES = {"f32": np.dtype("<f4"), "f16": np.dtype("<f2")}
OUTPUT_DTYPES = tuple(_DTYPES)


def pack_header(fields: dict) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


def unpack_header(frame: Any) -> dict:
    head = msgpack.unpackb(bytes(frame), raw=False, strict_map_key=False)
    if not isinstance(head, dict):
        raise ValueError("reply header is not a map")
    return head


def base_fields(
    model: str,
    input_kind: str,
    *,
    priority: int = 0,
    deadline: Optional[float] = None,
    truncate: Optional[bool] = None,
    output_dtype: str = "f32",
    dimensions: Optional[int] = None,
) -> dict:
    """The header keys shared by every request of one call (no ``v``/``id``/``timeout_us``)."""
    if not isinstance(model, str) or not model:
        raise TypeError("model must be a non-empty string (pass model= or set Client(model=...))")
    fields = {"model": model, "input": input_kind}
    if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
        raise TypeError("priority must be an int in 0..255")
    priority = int(priority)
    if not 0 <= priority <= 255:
        raise ValueError(f"priority must be in 0..255, got {priority}")
    if priority:
        fields["priority"] = priority
    if deadline is not None:
        d = float(deadline)
        if not math.isfinite(d):
            raise ValueError("deadline must be a finite time in seconds since the epoch")
        fields["deadline_unix_us"] = max(0, int(d * 1_000_000))
    if truncate is not None and not truncate:
        fields["truncate"] = False
    if output_dtype not in _DTYPES:
        raise ValueError(f"output_dtype must be one of {OUTPUT_DTYPES}, got {output_dtype!r}")
    if output_dtype != "f32":
        fields["output_dtype"] = output_dtype
    if dimensions is not None:
        if isinstance(dimensions, bool) or not isinstance(dimensions, (int, np.integer)) or dimensions < 1:
            raise ValueError(f"dimensions must be a positive int or None, got {dimensions!r}")
        fields["dimensions"] = int(dimensions)
    return fields


def text_frames(texts: Sequence[str]) -> List[bytes]:
    out = []
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"texts must be strings; item {i} is {type(t).__name__}")
        out.append(t.encode("utf-8", "surrogatepass"))
    return out


def ids_frames(seqs: Iterable[Any]) -> List[bytes]:
    out = []
    for i, s in enumerate(seqs):
        a = np.asarray(s)
        if a.ndim != 1:
            raise ValueError(f"id sequence {i} must be 1-D, got shape {a.shape}")
        if a.size and not np.issubdtype(a.dtype, np.integer):
            raise TypeError(f"id sequence {i} must hold integers, got {a.dtype}")
        if a.size and (a.min() < 0 or a.max() > 0xFFFFFFFF):
            raise ValueError(f"id sequence {i} has ids outside 0..2**32-1")
        out.append(a.astype("<u4", copy=False).tobytes())
    return out


def chunk_by(
    order: Sequence[int], sizes: Sequence[int], max_items: int, max_bytes: int
) -> List[List[int]]:
    """Split ``order`` (input positions) into runs of at most ``max_items``
    whose ``sizes`` add up to at most ``max_bytes`` (a single larger item gets
    a run of its own; the daemon will say whether it is too large)."""
    chunks: List[List[int]] = []
    cur: List[int] = []
    cur_bytes = 0
    for i in order:
        n = sizes[i]
        if cur and (len(cur) >= max_items or cur_bytes + n > max_bytes):
            chunks.append(cur)
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += n
    if cur:
        chunks.append(cur)
    return chunks


def decode_output(head: dict, frames: Sequence[Any]) -> np.ndarray:
    """The output tensor of an ``ok`` reply, as a read-only array over the frame."""
    dtype = _DTYPES.get(head.get("dtype"))
    shape = head.get("shape")
    if dtype is None or not isinstance(shape, list) or not all(
        isinstance(d, int) and d >= 0 for d in shape
    ):
        raise ProtocolError(
            f"reply has dtype {head.get('dtype')!r} and shape {shape!r}", head.get("id")
        )
    if len(frames) < 2:
        raise ProtocolError("ok reply without a tensor frame", head.get("id"))
    buf = frames[1]
    want = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(buf) != want:
        raise ProtocolError(
            f"tensor frame is {len(buf)} bytes, shape {shape} {head.get('dtype')} needs {want}",
            head.get("id"),
        )
    return np.frombuffer(buf, dtype=dtype).reshape(shape)


def check_rows(out: np.ndarray, rows: int, rid: Any) -> None:
    if out.ndim < 1 or out.shape[0] != rows:
        raise ProtocolError(
            f"reply has shape {list(out.shape)} for a request of {rows} rows", rid
        )


def assemble(
    results: Sequence[Tuple[List[int], np.ndarray]], n: int, dtype: Any = None
) -> np.ndarray:
    """Scatter per-request outputs back to input order."""
    if not results:
        return np.empty((0, 0), dtype=dtype or np.float32)
    first = results[0][1]
    out = np.empty((n,) + first.shape[1:], dtype=dtype or first.dtype)
    for idx, arr in results:
        if arr.shape[1:] != first.shape[1:]:
            raise ProtocolError(
                f"requests of one call got outputs of shapes {list(first.shape)} and {list(arr.shape)}"
            )
        out[np.asarray(idx, dtype=np.intp)] = arr
    return out
