"""A primary's update as it travels to the backup: its header and its gradient, in as few bytes as exact.

The backup must take the very step its primary took, so the gradient travels
exactly, but not always as dense fp32:

- **entries**: a sparse update (a :class:`~shoal.ps.sparse.SparseGrad`, from
  top-k pushes) sends its ``nnz`` int64 indices, then its ``nnz`` fp32 values,
  12 bytes an entry instead of 4 bytes an element of the shard. The backup
  steps with the same entries, as its primary did (sparse or dense, by the
  same optimizer's rule), so the two copies stay bit-identical.
- **half**: an update made of one push in ``bf16`` or ``fp16``
  (:attr:`Update.exact`: async, or a round of one worker) holds only values
  that dtype represents exactly, so it travels in it: 2 bytes an element. A
  sync round's average of several pushes is not exact in it and stays fp32.
- otherwise dense fp32, as before.

An update's embedding rows (:attr:`Update.rows`) travel after the gradient as one
:func:`shoal.state.tables.pack_rows` blob of ``rows_bytes``: in the same body on the TCP
channel, in frames of their own (``rows_part``) over gRPC.

On the TCP data channel an update is one message (its header, then the body);
over gRPC it is split into frames of ``chunk_bytes``, each header's
``offset``/``numel`` counting elements, or entries when ``entries`` is set.
Every size is checked against the first header before anything is allocated
(:class:`Incoming`), and a body that disagrees is refused whole.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch

from shoal.net import frames
from shoal.errors import InvalidArgument
from shoal.proto import shoal_pb2 as pb
from shoal.ps.ledger import BatchKey
from shoal.ps.sparse import SparseGrad
from shoal.ps.update import Update
from shoal.state.tables import MAX_ROWS_BYTES, pack_rows, unpack_rows

DTYPES = {"": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ENTRY_BYTES = 12                # an int64 index and an fp32 value


@dataclass(frozen=True)
class Encoded:
    """An update's gradient as it travels: ``count`` elements in ``dtype``, or ``count`` entries."""

    dtype: str
    entries: bool
    count: int
    indices: torch.Tensor | None    # entries only
    values: torch.Tensor            # the dense gradient in ``dtype``, or the entries' fp32 values

    def chunk(self, off: int, n: int) -> bytes | memoryview:
        """The bytes of elements (or entries) ``[off, off + n)``."""
        if not self.entries:
            return _bytes(self.values[off:off + n])
        assert self.indices is not None
        return b"".join((_bytes(self.indices[off:off + n]), _bytes(self.values[off:off + n])))

    def body(self) -> bytes | memoryview:
        return self.chunk(0, self.count)

    @property
    def itemsize(self) -> int:
        return ENTRY_BYTES if self.entries else DTYPES[self.dtype].itemsize


def _bytes(t: torch.Tensor) -> memoryview:
    return frames.tensor_bytes(t.contiguous().view(torch.uint8))


def encode(u: Update) -> Encoded:
    """How ``u``'s gradient travels (module docstring): its entries, a narrower exact dtype, or fp32."""
    if isinstance(u.grad, SparseGrad):
        return Encoded("", True, u.grad.nnz, u.grad.indices, u.grad.values)
    if u.exact:
        return Encoded(u.exact, False, u.grad.numel(), None, u.grad.to(DTYPES[u.exact]))
    return Encoded("", False, u.grad.numel(), None, u.grad)


def _rows_blob(u: Update) -> bytes:
    return pack_rows(u.rows) if u.rows else b""


def _header(shard: int, primary_id: str, u: Update, enc: Encoded, offset: int, n: int,
            first: bool, rows_bytes: int = 0) -> pb.ReplicateHeader:
    numel = u.grad.numel if isinstance(u.grad, SparseGrad) else u.grad.numel()
    head = pb.ReplicateHeader(shard=shard, version=u.version, primary_id=primary_id, offset=offset, numel=n,
                              shard_numel=numel, dtype=enc.dtype, entries=enc.entries,
                              nnz=enc.count if enc.entries else 0, sparse=u.sparse, rows_bytes=rows_bytes)
    if first:
        head.hparams.update(dict(u.hparams))
        head.keys.extend(u.keys)
        head.workers.extend(u.workers)
        head.batches.extend(pb.ReplicatedBatch(epoch=b.epoch, start=b.start, owner=o) for b, o in u.batches)
    return head


def update_message(shard: int, primary_id: str, u: Update) -> tuple[bytes, bytes | memoryview]:
    """The update sent whole (the TCP data channel): its header's bytes and its body."""
    enc, rows = encode(u), _rows_blob(u)
    head = _header(shard, primary_id, u, enc, 0, enc.count, True, len(rows)).SerializeToString()
    return head, (b"".join((enc.body(), rows)) if rows else enc.body())


def update_frames(shard: int, primary_id: str, u: Update, chunk_bytes: int) -> list[bytes]:
    """The update as gRPC frames of about ``chunk_bytes`` each; the first also carries keys, ledger
    entries and workers."""
    enc, rows = encode(u), _rows_blob(u)
    per = max(1, chunk_bytes // enc.itemsize)
    out, off = [], 0
    while True:
        n = min(per, enc.count - off)
        out.append(frames.pack(_header(shard, primary_id, u, enc, off, n, off == 0, len(rows)), enc.chunk(off, n)))
        off += n
        if off >= enc.count:
            break
    for at in range(0, len(rows), max(1, chunk_bytes)):
        part = rows[at:at + max(1, chunk_bytes)]
        head = _header(shard, primary_id, u, enc, at, len(part), False, len(rows))
        head.rows_part = True
        out.append(frames.pack(head, part))
    return out


class Incoming:
    """One replicated update being received. Its first header's form is checked on construction;
    :meth:`open` lets the caller refuse its sender (``check``) and only then allocates the buffer;
    chunks must follow in order and fill it."""

    def __init__(self, first: pb.ReplicateHeader):
        if first.dtype not in DTYPES:
            raise InvalidArgument(f"a replicated update in dtype {first.dtype!r}: not one of "
                                  f"{sorted(k or 'fp32' for k in DTYPES)}")
        if first.shard_numel < 0:
            raise InvalidArgument(f"a replicated update for a shard of {first.shard_numel} elements")
        if first.entries and (first.dtype or not 0 <= first.nnz <= first.shard_numel):
            raise InvalidArgument(f"a replicated update of {first.nnz} {first.dtype or 'fp32'} entries for a "
                                  f"shard of {first.shard_numel} elements: entries are fp32, at most one an element")
        if not first.entries and first.nnz:
            raise InvalidArgument(f"a dense replicated update that names {first.nnz} entries")
        if not 0 <= first.rows_bytes <= MAX_ROWS_BYTES:
            raise InvalidArgument(f"a replicated update with {first.rows_bytes} bytes of rows (at most {MAX_ROWS_BYTES})")
        self.first = first
        self.count = first.nnz if first.entries else first.shard_numel
        self.itemsize = ENTRY_BYTES if first.entries else DTYPES[first.dtype].itemsize
        self.covered = 0
        self.rows_covered = 0
        self._raw: torch.Tensor | None = None

    def open(self, check: Callable[[pb.ReplicateHeader], None] = lambda h: None) -> "Incoming":
        """``check(first header)`` may refuse the update; then its buffer is allocated."""
        check(self.first)
        self._raw = torch.empty(self.body_bytes, dtype=torch.uint8)
        return self

    @property
    def body_bytes(self) -> int:
        return self.count * self.itemsize + self.first.rows_bytes

    def check_whole(self, body_len: int) -> None:
        """An update sent whole (the TCP channel) must cover everything its header counts, in ``body_len``
        bytes; checked before :meth:`open`."""
        h = self.first
        if body_len != self.body_bytes or h.offset != 0 or h.numel != self.count or h.rows_part:
            raise InvalidArgument(f"a replicated update of {body_len} bytes for [{h.offset}, +{h.numel}): sent "
                                  f"whole, it must hold all {self.count} {'entries' if h.entries else 'elements'}, "
                                  f"{self.body_bytes} bytes")

    def whole(self) -> memoryview:
        """Where a body sent whole goes, once :meth:`check_whole` passed; counts it placed."""
        assert self._raw is not None, "open() first"
        self.covered, self.rows_covered = self.count, self.first.rows_bytes
        return frames.tensor_bytes(self._raw)

    def place(self, head: pb.ReplicateHeader, payload: memoryview) -> None:
        """One gRPC frame's chunk, in order."""
        f = self.first
        if head.rows_part:
            return self._place_rows(head, payload)
        if (head.shard, head.version, head.shard_numel, head.dtype, head.entries, head.nnz) != \
                (f.shard, f.version, f.shard_numel, f.dtype, f.entries, f.nnz) \
                or head.offset != self.covered or head.offset + head.numel > self.count:
            raise InvalidArgument(f"replicate chunk [{head.offset}, +{head.numel}) does not continue at "
                                  f"{self.covered} of {self.count}")
        assert self._raw is not None, "open() first"
        item = self.itemsize
        if len(payload) != head.numel * item:
            raise InvalidArgument(f"replicate chunk of {len(payload)} bytes for {head.numel} "
                                  f"{'entries' if f.entries else 'elements'}")
        a, n = head.offset, head.numel
        if f.entries:               # this chunk's indices, then its values
            self._raw[8 * a:8 * (a + n)] = _view(payload[:8 * n])
            self._raw[8 * self.count + 4 * a:8 * self.count + 4 * (a + n)] = _view(payload[8 * n:])
        else:
            self._raw[item * a:item * (a + n)] = _view(payload)
        self.covered += n

    def _place_rows(self, head: pb.ReplicateHeader, payload: memoryview) -> None:
        """A gRPC frame of the rows blob: after every chunk of the gradient, in order."""
        f, base = self.first, self.count * self.itemsize
        if (head.shard, head.version, head.rows_bytes) != (f.shard, f.version, f.rows_bytes) \
                or self.covered != self.count or head.offset != self.rows_covered \
                or len(payload) != head.numel or head.offset + head.numel > f.rows_bytes:
            raise InvalidArgument(f"replicated rows [{head.offset}, +{head.numel}) do not continue at "
                                  f"{self.rows_covered} of {f.rows_bytes} bytes")
        assert self._raw is not None, "open() first"
        self._raw[base + head.offset:base + head.offset + head.numel] = _view(payload)
        self.rows_covered += head.numel

    def update(self) -> Update:
        """The received update, once every chunk is in; a sparse one's indices are checked."""
        f = self.first
        if self._raw is None or self.covered != self.count or self.rows_covered != f.rows_bytes:
            raise InvalidArgument(f"replicated update covers {self.covered} of {self.count} "
                                  f"{'entries' if f.entries else 'elements'} and {self.rows_covered} of "
                                  f"{f.rows_bytes} bytes of rows")
        base = self.count * self.itemsize
        rows = tuple(unpack_rows(self._raw[base:].numpy().tobytes())) if f.rows_bytes else ()
        if f.entries:
            idx = self._raw[:8 * self.count].view(torch.int64)
            if not bool((idx[1:] > idx[:-1]).all()):
                raise InvalidArgument("a replicated update's indices are not strictly increasing")
            grad: torch.Tensor | SparseGrad = SparseGrad(idx, self._raw[8 * self.count:base].view(torch.float32),
                                                         f.shard_numel)
        else:
            grad = self._raw[:base].view(DTYPES[f.dtype])
            if f.dtype:
                grad = grad.to(torch.float32)
        batches = tuple((BatchKey(b.epoch, b.start), b.owner) for b in f.batches)
        return Update(f.version, grad, tuple(f.keys), batches, tuple(f.workers), sparse=f.sparse,
                      hparams=tuple(sorted(f.hparams.items())), exact=f.dtype, rows=rows)


def _view(payload: bytes | memoryview) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(payload, dtype=np.uint8))


def update_from_frames(frame_iter: Iterator[bytes], check: Callable[[pb.ReplicateHeader], None] = lambda h: None
                       ) -> tuple[pb.ReplicateHeader, Update]:
    """An update from its gRPC frames. ``check(first header)`` may refuse it before its gradient is
    allocated; a malformed one is :class:`InvalidArgument` (a ``ValueError``)."""
    incoming = None
    for frame in frame_iter:
        head, payload = frames.unpack(frame, pb.ReplicateHeader)
        if incoming is None:
            incoming = Incoming(head).open(check)
        incoming.place(head, payload)
    if incoming is None:
        raise InvalidArgument("a replicated update of no frames")
    return incoming.first, incoming.update()
