"""What the sync and async clients share: turning API calls into requests and
replies into results. Only the way a :class:`~replayd._core.Call` is executed
differs between them."""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import numpy as np

from . import _protocol as proto
from ._core import Call, Core

#: header bytes to leave room for under ``max_request_bytes``
_HEADER_ROOM = 4096

_ST_IGNORED = frozenset({"pool", "chunk_size"})


def _endpoint_list(endpoints: Union[str, Sequence[str]]) -> List[str]:
    if isinstance(endpoints, str):
        eps = [e.strip() for e in endpoints.split(",") if e.strip()]
    else:
        eps = [str(e) for e in endpoints]
    if not eps:
        raise ValueError("at least one endpoint is needed, e.g. 'tcp://127.0.0.1:5555'")
    if len(set(eps)) != len(eps):
        raise ValueError(f"endpoints listed twice: {eps}")
    for e in eps:
        if "://" not in e:
            raise ValueError(f"endpoint {e!r} is not a ZeroMQ address such as 'tcp://host:port' or 'ipc:///path'")
    return eps


def _need_torch(what: str):
    try:
        import torch  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            f"{what} returns torch tensors, but torch is not installed; "
            "install torch, or use the default convert_to_numpy=True"
        ) from e
    return torch


class _Progress:
    def __init__(self, total: int, enabled: Optional[bool]) -> None:
        self.bar = None
        self.done = 0
        self.total = total
        self.enabled = bool(enabled) and total > 0
        if self.enabled:
            try:
                from tqdm.auto import tqdm  # optional

                self.bar = tqdm(total=total, desc="Batches", unit="text")
            except ImportError:
                self.bar = None

    def update(self, rows: int) -> None:
        if not self.enabled:
            return
        self.done += rows
        if self.bar is not None:
            self.bar.update(rows)
        else:
            sys.stderr.write(f"\rencoded {self.done}/{self.total}")
            if self.done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class _Prepared:
    """A call ready to run and how to turn its outputs into the result."""

    __slots__ = ("call", "finish", "progress")

    def __init__(self, call: Call, finish: Callable[[Call], Any], progress: Optional[_Progress] = None):
        self.call = call
        self.finish = finish
        self.progress = progress


class _ClientBase:
    def __init__(
        self,
        endpoints: Union[str, Sequence[str]],
        model: Optional[str] = None,
        timeout: Optional[float] = 60.0,
        *,
        # At most half the daemon's server.send_hwm (1,000 by default), past
        # which it drops replies: see the README.
        max_in_flight: int = 256,
        max_attempts: int = 4,
        liveness_timeout: Optional[float] = 30.0,
        max_items_per_request: int = proto.DEFAULT_MAX_ITEMS,
        max_request_bytes: int = proto.DEFAULT_MAX_BYTES,
        reconnect_interval: float = 0.1,
        overload_backoff: float = 0.05,
        overload_backoff_max: float = 2.0,
        unavailable_backoff: float = 1.0,
        prompts: Optional[Dict[str, str]] = None,
        default_prompt_name: Optional[str] = None,
    ) -> None:
        self._addresses = _endpoint_list(endpoints)
        if timeout is not None and not timeout > 0:
            raise ValueError("timeout must be > 0 seconds, or None to wait for ever")
        if max_in_flight < 1 or max_attempts < 1 or max_items_per_request < 1:
            raise ValueError("max_in_flight, max_attempts and max_items_per_request must be >= 1")
        if liveness_timeout is not None and not liveness_timeout > 0:
            raise ValueError("liveness_timeout must be > 0 seconds, or None")
        self.model = model
        self.timeout = timeout
        self.max_items_per_request = int(max_items_per_request)
        self.max_request_bytes = int(max_request_bytes)
        self.reconnect_interval = float(reconnect_interval)
        self.prompts = dict(prompts or {})
        if default_prompt_name is not None and default_prompt_name not in self.prompts:
            raise ValueError(
                f"default_prompt_name {default_prompt_name!r} is not in prompts {sorted(self.prompts)}"
            )
        self.default_prompt_name = default_prompt_name
        self._core = Core(
            self._addresses,
            max_in_flight=int(max_in_flight),
            max_attempts=int(max_attempts),
            liveness_timeout=liveness_timeout,
            backoff=overload_backoff,
            backoff_max=overload_backoff_max,
            unavailable_backoff=unavailable_backoff,
        )

    @property
    def endpoints(self) -> List[str]:
        return list(self._addresses)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._addresses!r}, model={self.model!r})"

    # ---------------------------------------------------------------- helpers

    def _model(self, model: Optional[str]) -> str:
        m = model if model is not None else self.model
        if m is None:
            raise TypeError("no model given: pass model=... or create the client with model=...")
        return m

    def _timeout(self, timeout: Optional[float]) -> Optional[float]:
        t = self.timeout if timeout is None else timeout
        if t is not None and not t > 0:
            raise ValueError("timeout must be > 0 seconds")
        return t

    def _batch(self, batch_size: Optional[int]) -> int:
        if batch_size is None:
            return self.max_items_per_request
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)):
            raise TypeError(f"batch_size must be an int, got {type(batch_size).__name__}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        return min(int(batch_size), self.max_items_per_request)

    def _items_call(
        self,
        frames: List[bytes],
        order: Sequence[int],
        fields: dict,
        batch_size: Optional[int],
        timeout: Optional[float],
        deadline: Optional[float],
    ) -> Call:
        call = Call(self._timeout(timeout), deadline)
        sizes = [len(f) for f in frames]
        limit = max(1, self.max_request_bytes - _HEADER_ROOM)
        for idx in proto.chunk_by(order, sizes, self._batch(batch_size), limit):
            if len(idx) == 1 and sizes[idx[0]] > limit:
                self._too_big(f"item {idx[0]} is {sizes[idx[0]]} bytes")
            call.add(fields, [frames[i] for i in idx], idx)
        return call

    def _too_big(self, what: str) -> None:
        # The daemon closes the connection on a message over its limit without
        # a reply (libzmq refuses it before reading the body): say so here.
        raise ValueError(
            f"{what}, more than fits one request under max_request_bytes = "
            f"{self.max_request_bytes} (the daemon's server.max_request_bytes, less "
            f"{_HEADER_ROOM} bytes for the header); the daemon would drop the "
            "connection without a reply. Shorten the input, or raise both limits."
        )

    # ------------------------------------------------------------ preparing

    def _prep_embed(
        self,
        texts: Union[str, Sequence[str]],
        model: Optional[str],
        batch_size: Optional[int],
        timeout: Optional[float],
        priority: int,
        deadline: Optional[float],
        truncate: bool,
        output_dtype: str,
        dimensions: Optional[int] = None,
    ) -> _Prepared:
        return self._prep_texts(
            texts, model, batch_size, timeout, priority, deadline, truncate, output_dtype,
            proto.assemble, dimensions=dimensions,
        )

    def _prep_embed_sparse(
        self,
        texts: Union[str, Sequence[str]],
        model: Optional[str],
        top_k: Optional[int],
        batch_size: Optional[int],
        timeout: Optional[float],
        priority: int,
        deadline: Optional[float],
        truncate: bool,
        output_dtype: str,
    ) -> _Prepared:
        return self._prep_texts(
            texts, model, batch_size, timeout, priority, deadline, truncate, output_dtype,
            proto.assemble_sparse, top_k=top_k,
        )

    def _prep_texts(
        self,
        texts: Union[str, Sequence[str]],
        model: Optional[str],
        batch_size: Optional[int],
        timeout: Optional[float],
        priority: int,
        deadline: Optional[float],
        truncate: bool,
        output_dtype: str,
        assemble: Callable[[Any, int], Any],
        **extra: Any,
    ) -> _Prepared:
        """A ``texts`` call: the texts grouped longest first into requests,
        their outputs put back in input order by ``assemble``."""
        if isinstance(texts, str):
            texts = [texts]
        texts = list(texts)
        fields = proto.base_fields(
            self._model(model),
            "texts",
            priority=priority,
            deadline=deadline,
            truncate=truncate,
            output_dtype=output_dtype,
            **extra,
        )
        frames = proto.text_frames(texts)
        # Longest first, as sentence-transformers does: texts of similar length
        # share a request, so the daemon pads each request less.
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        call = self._items_call(frames, order, fields, batch_size, timeout, deadline)
        n = len(texts)
        return _Prepared(call, lambda c: assemble(c.outputs(), n))

    def _prep_embed_ids(
        self,
        sequences: Sequence[Sequence[int]],
        model: Optional[str],
        batch_size: Optional[int],
        timeout: Optional[float],
        priority: int,
        deadline: Optional[float],
        output_dtype: str,
        dimensions: Optional[int] = None,
    ) -> _Prepared:
        seqs = list(sequences)  # a list of lists, of arrays, or a 2-D array
        fields = proto.base_fields(
            self._model(model),
            "ids",
            priority=priority,
            deadline=deadline,
            output_dtype=output_dtype,
            dimensions=dimensions,
        )
        frames = proto.ids_frames(seqs)
        order = sorted(range(len(frames)), key=lambda i: -len(frames[i]))
        call = self._items_call(frames, order, fields, batch_size, timeout, deadline)
        n = len(frames)
        return _Prepared(call, lambda c: proto.assemble(c.outputs(), n))

    def _prep_infer(
        self,
        model: str,
        array: Any,
        batch_size: Optional[int],
        timeout: Optional[float],
        priority: int,
        deadline: Optional[float],
        output_dtype: str,
    ) -> _Prepared:
        x = np.ascontiguousarray(np.asarray(array, dtype="<f4"))
        if x.ndim == 0:
            raise ValueError("infer needs a 2-D array of rows (or one 1-D row)")
        one_row = x.ndim == 1
        if one_row:
            x = x.reshape(1, -1)
        fields = proto.base_fields(
            self._model(model), "tensor", priority=priority, deadline=deadline, output_dtype=output_dtype
        )
        fields["dtype"] = "f32"
        rows = x.shape[0]
        row_bytes = max(1, x[0].nbytes) if rows else 1
        if row_bytes > self.max_request_bytes - _HEADER_ROOM:
            self._too_big(f"one row is {row_bytes} bytes")
        per = min(self._batch(batch_size), max(1, (self.max_request_bytes - _HEADER_ROOM) // row_bytes))
        call = Call(self._timeout(timeout), deadline)
        for start in range(0, rows, per):
            part = x[start : start + per]
            f = dict(fields)
            f["shape"] = list(part.shape)
            call.add(f, [memoryview(part).cast("B")], list(range(start, start + part.shape[0])))

        def finish(c: Call) -> np.ndarray:
            out = proto.assemble(c.outputs(), rows)
            return out[0] if one_row else out

        return _Prepared(call, finish)

    def _prep_encode(
        self,
        sentences: Union[str, Sequence[str]],
        prompt_name: Optional[str],
        prompt: Optional[str],
        batch_size: int,
        show_progress_bar: Optional[bool],
        output_value: Optional[str],
        precision: str,
        convert_to_numpy: bool,
        convert_to_tensor: bool,
        device: Any,
        normalize_embeddings: bool,
        truncate_dim: Optional[int],
        model: Optional[str],
        timeout: Optional[float],
        priority: int,
        deadline: Optional[float],
        truncate: bool,
        kwargs: dict,
    ) -> _Prepared:
        unknown = set(kwargs) - _ST_IGNORED
        if unknown:
            raise TypeError(f"encode() got unexpected keyword arguments {sorted(unknown)}")
        if prompt_name is not None and not isinstance(prompt_name, str):
            raise TypeError(
                "prompt_name must be a str. (As in sentence-transformers >= 3, the second "
                "positional parameter of encode is prompt_name: pass batch_size=... by name.)"
            )
        if output_value != "sentence_embedding":
            raise ValueError(
                f"output_value={output_value!r} is not supported: replayd returns pooled "
                "sentence embeddings only (output_value='sentence_embedding')"
            )
        if precision != "float32":
            raise ValueError(f"precision={precision!r} is not supported; only 'float32'")
        if truncate_dim is not None and (isinstance(truncate_dim, bool) or int(truncate_dim) < 1):
            raise ValueError("truncate_dim must be a positive int or None")
        wants_torch = convert_to_tensor or not convert_to_numpy
        torch = _need_torch("convert_to_tensor=True" if convert_to_tensor else "convert_to_numpy=False") if wants_torch else None

        input_was_string = isinstance(sentences, str) or not hasattr(sentences, "__len__")
        texts = [sentences] if input_was_string else list(sentences)

        if prompt is None:
            if prompt_name is not None:
                if prompt_name not in self.prompts:
                    raise ValueError(
                        f"Prompt name {prompt_name!r} not found in the configured prompts "
                        f"dictionary with keys {sorted(self.prompts)!r} (Client(prompts=...))"
                    )
                prompt = self.prompts[prompt_name]
            elif self.default_prompt_name is not None:
                prompt = self.prompts[self.default_prompt_name]
        if prompt:
            texts = [prompt + t for t in texts]

        progress = _Progress(len(texts), show_progress_bar)
        prep = self._prep_embed(texts, model, batch_size, timeout, priority, deadline, truncate, "f32")
        embed_finish = prep.finish
        if progress.enabled:
            prep.call.on_progress = progress.update
        dim = int(truncate_dim) if truncate_dim is not None else None

        def finish(c: Call):
            emb = embed_finish(c)
            if dim is not None and emb.ndim == 2:
                emb = emb[:, :dim]
            emb = np.ascontiguousarray(emb, dtype=np.float32)
            if normalize_embeddings and emb.size:
                norms = np.linalg.norm(emb, axis=1, keepdims=True)
                emb = emb / np.maximum(norms, 1e-12)
            if torch is not None:
                t = torch.from_numpy(emb)
                if device is not None:
                    t = t.to(device)
                if convert_to_tensor:
                    return t[0] if input_was_string and len(t) else t
                rows = list(t)
                return rows[0] if input_was_string and rows else rows
            return emb[0] if input_was_string and len(emb) else emb

        prep.finish = finish
        prep.progress = progress
        return prep
