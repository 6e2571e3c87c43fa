"""The codec contract, the name registry, the error type and shared helpers.

Every payload is little-endian and carries no header: the decoder is told
``numel`` (the wire frame carries it) and each format's length follows from it,
so a payload whose length does not fit is rejected. Chunked formats (``int8``,
``sign``) cut the tensor into chunks of :data:`CHUNK` elements, the last one
possibly shorter; the chunk size is part of the format, not an option, so a
tag alone (see :mod:`shoal.codecs.compressor`) always names a working decoder.
"""
from __future__ import annotations

import abc
import inspect
import operator
from typing import TypeVar

import numpy as np
import torch

CHUNK = 4096
"""Elements per scale in the chunked formats (``int8``, ``sign``)."""

Buffer = bytes | bytearray | memoryview


class CodecError(ValueError):
    """An unknown codec, a bad option, an unusable input or a malformed payload."""


class Codec(abc.ABC):
    """Turns a 1-D fp32 tensor into a compact payload and back.

    ``biased`` says whether the codec drops information systematically enough
    that error feedback should carry what it lost into the next step. ``sparse``:
    a decoded tensor is zero outside a few elements.
    """

    name: str = ""
    biased: bool = False
    sparse: bool = False

    @abc.abstractmethod
    def encode(self, x: torch.Tensor) -> bytes:
        """The payload of the 1-D fp32 tensor ``x`` (CPU or CUDA; math runs on its device)."""

    @abc.abstractmethod
    def decode(self, buf: Buffer, numel: int) -> torch.Tensor:
        """A new 1-D fp32 CPU tensor of ``numel`` elements; :class:`CodecError` if ``buf`` is malformed."""

    @abc.abstractmethod
    def encoded_size(self, numel: int) -> int | None:
        """The exact payload size for ``numel`` elements, or None when it varies."""

    def decode_entries(self, buf: Buffer, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sparse codec's payload as ``(indices, values)``: int64 strictly increasing, fp32 (every
        other element is zero); a sparse codec must override it."""
        raise CodecError(f"codec {self.name} is not sparse: its payloads decode to every element")

    def encoded_size_bound(self, numel: int) -> int:
        """The largest payload :meth:`decode` accepts for ``numel`` elements."""
        size = self.encoded_size(numel)
        assert size is not None, f"{type(self).__name__} must override encoded_size_bound"
        return size

    def encode_with_approx(self, x: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        """``(payload, decode(payload))``, the second on ``x``'s device (for error feedback)."""
        payload = self.encode(x)
        return payload, self.decode(payload, x.numel()).to(x.device)

    def encode_residual_(self, x: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        """``(payload, x - decode(payload))``, the second in ``x``'s own storage (``x`` is consumed):
        what error feedback keeps. Codecs that know their residual cheaper override it."""
        payload, approx = self.encode_with_approx(x)
        return payload, x.sub_(approx)

    def encode_feedback(self, grad: torch.Tensor, residual: torch.Tensor | None) -> tuple[bytes, torch.Tensor]:
        """``encode_residual_(grad + residual)`` (``residual`` None: zero) in new storage: neither input
        changes, so a failed encode leaves the old residual as it was. Codecs that can fuse the sum
        into their encoding override it."""
        corrected = grad.clone() if residual is None else grad + residual.to(grad.device)
        return self.encode_residual_(corrected)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ChunkScaledCodec(Codec):
    """A biased chunked format (``int8``, ``sign``) whose encoder yields its own approximation.

    Subclasses write :meth:`_encode`; the decoded values for error feedback come
    from the encoder's arithmetic instead of a decode of the payload.
    """

    biased = True

    @abc.abstractmethod
    def _encode(self, x: torch.Tensor, want_approx: bool) -> tuple[bytes, torch.Tensor | None]:
        """``(payload, approximation or None)`` of a checked input."""

    def encode(self, x: torch.Tensor) -> bytes:
        return self._encode(check_input(x), want_approx=False)[0]

    def encode_with_approx(self, x: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        payload, approx = self._encode(check_input(x), want_approx=True)
        assert approx is not None
        return payload, approx


C = TypeVar("C", bound=type[Codec])
_REGISTRY: dict[str, type[Codec]] = {}


def register_codec(cls: C) -> C:
    """Class decorator: makes ``cls`` available to :func:`get_codec` under ``cls.name``."""
    if not cls.name or cls.name in _REGISTRY:
        raise ValueError(f"codec name {cls.name!r} is empty or taken")
    _REGISTRY[cls.name] = cls
    return cls


def known_codecs() -> list[str]:
    """The registered codec names, sorted."""
    return sorted(_REGISTRY)


def get_codec(name: str, **options: object) -> Codec:
    """A codec instance by name; :class:`CodecError` for an unknown name or option."""
    cls = _REGISTRY.get(name)
    if cls is None:
        raise CodecError(f"unknown compressor {name!r}; known: {', '.join(known_codecs())}")
    params = inspect.signature(cls).parameters
    unknown = sorted(set(options) - set(params))
    if unknown:
        accepted = ", ".join(params) or "none"
        raise CodecError(f"codec {name!r} does not take option(s) {', '.join(unknown)}; accepted: {accepted}")
    return cls(**options)


# ---------------------------------------------------------------- input checks

def check_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a detached contiguous tensor, or :class:`CodecError` if it is not 1-D fp32."""
    if not isinstance(x, torch.Tensor):
        raise CodecError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32 or x.dim() != 1:
        raise CodecError(f"expected a 1-D float32 tensor, got {x.dim()}-D {x.dtype}")
    if x.numel() >= 2**31:
        raise CodecError(f"tensor of {x.numel()} elements is too large for one payload (max 2**31 - 1)")
    return x.detach().contiguous()


def check_numel(numel: int) -> int:
    """``numel`` as a non-negative int, or :class:`CodecError`."""
    try:
        n = operator.index(numel)
    except TypeError:
        raise CodecError(f"numel must be an integer, got {numel!r}") from None
    if n < 0 or isinstance(numel, bool):
        raise CodecError(f"numel must be a non-negative integer, got {numel!r}")
    return n


def as_bytes(buf: Buffer) -> memoryview:
    """A flat byte view of ``buf`` (bytes, bytearray, memoryview or any buffer)."""
    try:
        view = memoryview(buf)
        return view if view.format == "B" and view.ndim == 1 else view.cast("B")
    except TypeError as exc:
        raise CodecError(f"payload must be a contiguous bytes-like object, got {type(buf).__name__}") from exc


def check_length(name: str, view: memoryview, expected: int, numel: int) -> None:
    """:class:`CodecError` unless the payload is exactly ``expected`` bytes."""
    if view.nbytes != expected:
        raise CodecError(f"{name} payload for {numel} elements must be {expected} bytes, got {view.nbytes}")


# ---------------------------------------------------------------- byte conversion

def to_bytes(*parts: torch.Tensor) -> bytes:
    """The raw bytes of ``parts`` concatenated, moved to the CPU in one transfer.

    From a GPU the transfer lands in page-locked memory (torch's caching host allocator reuses it):
    a copy to pageable memory is staged through a driver buffer, about 40x slower on an H200
    (bench/cuda_check.py)."""
    flat = [p.reshape(-1).view(torch.uint8) for p in parts]
    joined = flat[0] if len(flat) == 1 else torch.cat(flat)
    if joined.is_cuda:
        host = torch.empty(joined.numel(), dtype=torch.uint8, pin_memory=True)
        host.copy_(joined)
        return host.numpy().tobytes()
    return joined.cpu().numpy().tobytes()


def read_tensor(view: memoryview, dtype: torch.dtype, count: int, offset: int = 0) -> torch.Tensor:
    """``count`` values of ``dtype`` at byte ``offset``, copied into a new writable CPU tensor.

    The one copy is of the compact payload bytes: torch cannot own memory of an
    immutable ``bytes`` object, and the copy keeps the result independent of it.
    """
    if count == 0:
        return torch.empty(0, dtype=dtype)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    raw = np.frombuffer(view, dtype=np.uint8, count=nbytes, offset=offset).copy()
    return torch.from_numpy(raw).view(dtype)


# ---------------------------------------------------------------- chunked formats

def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ints."""
    return -(-a // b)


def num_chunks(numel: int) -> int:
    """How many :data:`CHUNK`-element chunks cover ``numel`` elements."""
    return ceil_div(numel, CHUNK)


def chunk_rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``(num_chunks, CHUNK)`` rows; the last row is zero-padded (a copy only then)."""
    rows = num_chunks(x.numel())
    pad = rows * CHUNK - x.numel()
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.view(rows, CHUNK)


def chunk_counts(numel: int, device: torch.device) -> torch.Tensor:
    """The number of real elements in each chunk, as fp32 on ``device``."""
    counts = torch.full((num_chunks(numel),), float(CHUNK), device=device)
    if numel % CHUNK:
        counts[-1] = numel % CHUNK
    return counts


def scale_chunks_(out: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Multiplies each chunk of the 1-D ``out`` in place by its entry of ``scales``."""
    full = out.numel() // CHUNK
    if full:
        out[:full * CHUNK].view(full, CHUNK).mul_(scales[:full, None])
    if out.numel() % CHUNK:
        out[full * CHUNK:].mul_(scales[full])
    return out


def read_scales(name: str, view: memoryview, count: int) -> torch.Tensor:
    """The ``count`` fp32 chunk scales at the start of a payload; they must be finite and >= 0."""
    scales = read_tensor(view, torch.float32, count)
    if count and not bool(((scales >= 0) & torch.isfinite(scales)).all()):
        raise CodecError(f"{name} payload has a negative or non-finite chunk scale")
    return scales


def check_encoded_scales(name: str, payload: bytes, count: int) -> None:
    """:class:`CodecError` if the encoder produced non-finite scales (the input had inf/NaN)."""
    if count and not np.isfinite(np.frombuffer(payload, dtype="<f4", count=count)).all():
        raise CodecError(f"{name} cannot encode a tensor holding inf or NaN")
