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
    top_k: Optional[int] = None,
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
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1:
            raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
        fields["top_k"] = int(top_k)
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


class SparseEmbeddings:
    """A sparse encoder's rows (SPLADE weights over the vocabulary) in CSR form:
    row ``i``'s entries are ``indices[indptr[i]:indptr[i+1]]`` (vocabulary ids,
    ascending) with ``values`` alike. ``scipy.sparse.csr_matrix((values, indices,
    indptr), shape)`` takes them as they are (:meth:`to_scipy`)."""

    def __init__(self, indptr: np.ndarray, indices: np.ndarray, values: np.ndarray, shape: Tuple[int, int]):
        self.indptr = indptr
        self.indices = indices
        self.values = values
        self.shape = (int(shape[0]), int(shape[1]))

    def __len__(self) -> int:
        return self.shape[0]

    def row(self, i: int) -> Tuple[np.ndarray, np.ndarray]:
        """Row ``i``'s (indices, values)."""
        a, b = int(self.indptr[i]), int(self.indptr[i + 1])
        return self.indices[a:b], self.values[a:b]

    def __iter__(self):
        return (self.row(i) for i in range(len(self)))

    def to_dense(self) -> np.ndarray:
        out = np.zeros(self.shape, dtype=self.values.dtype)
        for i in range(len(self)):
            idx, val = self.row(i)
            out[i, idx] = val
        return out

    def to_scipy(self):
        import scipy.sparse  # optional dependency

        return scipy.sparse.csr_matrix((self.values, self.indices, self.indptr), shape=self.shape)

    def __repr__(self) -> str:
        return f"SparseEmbeddings(rows={self.shape[0]}, width={self.shape[1]}, nnz={len(self.indices)})"


def _decode_csr(head: dict, frames: Sequence[Any], dtype: np.dtype, shape: list) -> SparseEmbeddings:
    rid = head.get("id")
    if len(shape) != 2 or len(frames) != 4:
        raise ProtocolError(
            f"sparse reply has shape {shape!r} and {len(frames) - 1} payload frames (expected [rows, width] and 3)",
            rid,
        )
    rows, width = shape
    bufs = [bytes(f) if not isinstance(f, (bytes, bytearray, memoryview)) else f for f in frames[1:]]
    if len(bufs[0]) % 4 or len(bufs[1]) % 4:
        raise ProtocolError("sparse reply's indptr or indices is not whole u32s", rid)
    indptr = np.frombuffer(bufs[0], dtype="<u4")
    indices = np.frombuffer(bufs[1], dtype="<u4")
    if len(bufs[2]) != len(indices) * dtype.itemsize:
        raise ProtocolError("sparse reply's values and indices differ in length", rid)
    values = np.frombuffer(bufs[2], dtype=dtype)
    if (
        len(indptr) != rows + 1
        or (rows >= 0 and len(indptr) and (indptr[0] != 0 or indptr[-1] != len(indices)))
        or np.any(np.diff(indptr.astype(np.int64)) < 0)
        or (len(indices) and int(indices.max()) >= width)
    ):
        raise ProtocolError("sparse reply's indptr and indices are inconsistent", rid)
    return SparseEmbeddings(indptr, indices, values, (rows, width))


def decode_output(head: dict, frames: Sequence[Any]) -> Any:
    """The output of an ``ok`` reply: a read-only array over the tensor frame,
    or for a sparse encoder (``format: "csr"``) a :class:`SparseEmbeddings`."""
    dtype = _DTYPES.get(head.get("dtype"))
    shape = head.get("shape")
    if dtype is None or not isinstance(shape, list) or not all(
        isinstance(d, int) and d >= 0 for d in shape
    ):
        raise ProtocolError(
            f"reply has dtype {head.get('dtype')!r} and shape {shape!r}", head.get("id")
        )
    if head.get("format") == "csr":
        return _decode_csr(head, frames, dtype, shape)
    if head.get("format") is not None:
        raise ProtocolError(f"unknown reply format {head.get('format')!r}", head.get("id"))
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


def check_rows(out: Any, rows: int, rid: Any) -> None:
    if isinstance(out, SparseEmbeddings):
        if len(out) != rows:
            raise ProtocolError(f"sparse reply has {len(out)} rows for a request of {rows}", rid)
        return
    if out.ndim < 1 or out.shape[0] != rows:
        raise ProtocolError(
            f"reply has shape {list(out.shape)} for a request of {rows} rows", rid
        )


def assemble_sparse(results: Sequence[Tuple[List[int], Any]], n: int) -> SparseEmbeddings:
    """Per-request sparse rows back in input order, as one :class:`SparseEmbeddings`."""
    rows: List[Any] = [None] * n
    width = 0
    for idx, part in results:
        if not isinstance(part, SparseEmbeddings):
            raise ProtocolError("a sparse call got a dense reply")
        width = part.shape[1]
        for j, i in enumerate(idx):
            rows[i] = part.row(j)
    vdtype = results[0][1].values.dtype if results else np.dtype("<f4")
    indptr = np.zeros(n + 1, dtype=np.uint32)
    for i, r in enumerate(rows):
        indptr[i + 1] = indptr[i] + (len(r[0]) if r is not None else 0)
    indices = np.concatenate([r[0] for r in rows if r is not None]) if n else np.empty(0, np.uint32)
    values = np.concatenate([r[1] for r in rows if r is not None]) if n else np.empty(0, vdtype)
    return SparseEmbeddings(indptr, indices.astype(np.uint32), values, (n, width))


def assemble(
    results: Sequence[Tuple[List[int], np.ndarray]], n: int, dtype: Any = None
) -> np.ndarray:
    """Scatter per-request outputs back to input order."""
    if not results:
        return np.empty((0, 0), dtype=dtype or np.float32)
    first = results[0][1]
    if isinstance(first, SparseEmbeddings):
        raise ValueError("the model is a sparse encoder: its rows come back from embed_sparse")
    out = np.empty((n,) + first.shape[1:], dtype=dtype or first.dtype)
    for idx, arr in results:
        if arr.shape[1:] != first.shape[1:]:
            raise ProtocolError(
                f"requests of one call got outputs of shapes {list(first.shape)} and {list(arr.shape)}"
            )
        out[np.asarray(idx, dtype=np.intp)] = arr
    return out
