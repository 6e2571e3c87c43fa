"""Embedding tables served by the parameter servers: what a worker and a server agree on.

A table's rows are spread over the job's shards by a hash of the row id
(:func:`partition_of`): row ``i`` belongs to shard ``partition_of(i, num_shards)``,
inside the dense shard of that number, so placement, replication, promotion,
checkpoints and the per-shard ledger of that shard cover its rows. Worker and
server call the same function.

Rows never travel as protobuf repeated fields. A push's row gradients (and a
replicated update's rows) are one blob (:func:`pack_rows` / :func:`unpack_rows`):

    u32 number of tables, then per table:
    u16 name length, u32 dim, u64 n, the name (utf-8), n int64 ids, n*dim fp32 values

all little-endian, decoded with ``np.frombuffer``. A lookup sends the ids as raw
int64 bytes behind a :class:`RowsHeader` and gets the rows back as raw fp32
(or bf16/fp16, ``dtype``) behind the same header.

A table is declared to its shards at Init as JSON (:func:`specs_to_json`): a list of
dicts with the fields of ``shoal.ps.tables.TableSpec``.
"""
from __future__ import annotations

import json
import struct
from typing import Any, Iterable, Sequence

import numpy as np

from shoal.errors import InvalidArgument

ROWS_CODEC = "rows"             # the codec tag of a push's last frame: the row gradients (pack_rows)
MAX_ROWS_BYTES = 1 << 31        # one push's or update's row blob; larger is a broken or hostile peer
MAX_LOOKUP_IDS = 1 << 24        # ids one lookup may name
ROW_DTYPES = {"": np.float32, "float32": np.float32, "float16": np.float16}   # bf16: see encode_rows

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_TABLE_HEAD = struct.Struct("<HIQ")
_COUNT = struct.Struct("<I")


def mix64(ids: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over int64 ids (as uint64, wrapping): a well-spread 64-bit hash."""
    z = np.asarray(ids, dtype=np.int64).view(np.uint64) + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def partition_of(ids: np.ndarray, num_shards: int) -> np.ndarray:
    """The shard (int64, in ``[0, num_shards)``) that holds each row id."""
    if num_shards < 1:
        raise InvalidArgument(f"a table needs at least 1 shard, got {num_shards}")
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if num_shards == 1:
        return np.zeros(len(ids), dtype=np.int64)
    return (mix64(ids) % np.uint64(num_shards)).astype(np.int64)


def split_by_shard(ids: np.ndarray, num_shards: int) -> dict[int, np.ndarray]:
    """Positions in ``ids`` of the ids each shard holds (only shards that hold some)."""
    part = partition_of(ids, num_shards)
    order = np.argsort(part, kind="stable")
    bounds = np.searchsorted(part[order], np.arange(num_shards + 1))
    return {k: order[bounds[k]:bounds[k + 1]] for k in range(num_shards) if bounds[k + 1] > bounds[k]}


def sum_rows(parts: Sequence[tuple[np.ndarray, np.ndarray]], dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Row gradients given as ``(ids, grads)`` pairs, summed per id: (unique sorted ids, fp32 sums).
    The sum runs in the order given (the push order of a round), so every copy gets the same bits."""
    if not parts:
        return np.empty(0, np.int64), np.empty((0, dim), np.float32)
    ids = np.concatenate([p[0] for p in parts])
    grads = np.concatenate([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
    uniq, inverse = np.unique(ids, return_inverse=True)
    if len(uniq) == len(ids) and len(parts) == 1 and bool(np.all(ids[1:] > ids[:-1])):
        return ids, np.ascontiguousarray(grads, dtype=np.float32)
    out = np.zeros((len(uniq), dim), dtype=np.float32)
    np.add.at(out, inverse.reshape(-1), grads)
    return uniq, out


def pack_rows(tables: Iterable[tuple[str, np.ndarray, np.ndarray]]) -> bytes:
    """``(name, ids int64 (n,), values fp32 (n, dim))`` per table, as one blob (module docstring)."""
    items = list(tables)
    out = [_COUNT.pack(len(items))]
    for name, ids, values in items:
        raw = name.encode()
        values = np.ascontiguousarray(values, dtype=np.float32)
        n, dim = values.shape
        if len(ids) != n:
            raise InvalidArgument(f"table {name!r}: {len(ids)} ids for {n} rows")
        out += [_TABLE_HEAD.pack(len(raw), dim, n), raw, np.ascontiguousarray(ids, dtype=np.int64).tobytes(),
                values.tobytes()]
    return b"".join(out)


def unpack_rows(buf: bytes | memoryview) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """The tables of a :func:`pack_rows` blob; a blob that does not add up is InvalidArgument."""
    view = memoryview(buf).cast("B")
    if len(view) < _COUNT.size:
        raise InvalidArgument(f"a row blob of {len(view)} bytes holds no table count")
    (count,), at, out = _COUNT.unpack_from(view, 0), _COUNT.size, []
    for _ in range(count):
        if at + _TABLE_HEAD.size > len(view):
            raise InvalidArgument(f"a row blob of {len(view)} bytes ends inside a table header at byte {at}")
        name_len, dim, n = _TABLE_HEAD.unpack_from(view, at)
        at += _TABLE_HEAD.size
        size = name_len + 8 * n + 4 * n * dim
        if dim < 1 or at + size > len(view):
            raise InvalidArgument(f"a row blob's table of {n} rows x {dim} needs {size} bytes at byte {at}; "
                                  f"the blob has {len(view)}")
        try:
            name = bytes(view[at:at + name_len]).decode()
        except UnicodeDecodeError:
            raise InvalidArgument("a row blob names a table in bytes that are not utf-8") from None
        at += name_len
        ids = np.frombuffer(view, dtype=np.int64, count=n, offset=at)
        at += 8 * n
        values = np.frombuffer(view, dtype=np.float32, count=n * dim, offset=at).reshape(n, dim)
        at += 4 * n * dim
        out.append((name, ids, values))
    if at != len(view):
        raise InvalidArgument(f"a row blob of {len(view)} bytes has {len(view) - at} bytes after its {count} table(s)")
    names = [t[0] for t in out]
    if len(set(names)) != len(names):
        raise InvalidArgument(f"a row blob names a table twice: {names}")
    return out


def encode_rows(rows: np.ndarray, dtype: str) -> bytes:
    """Looked-up rows for the wire: fp32, ``float16`` or ``bfloat16`` (the top half of each fp32, rounded)."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    if dtype in ("", "float32"):
        return rows.tobytes()
    if dtype == "float16":
        return rows.astype(np.float16).tobytes()
    if dtype == "bfloat16":
        bits = rows.view(np.uint32)
        rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
        return (rounded >> np.uint32(16)).astype(np.uint16).tobytes()
    raise InvalidArgument(f"unknown row dtype {dtype!r}; known: float32, float16, bfloat16")


def decode_rows(buf: bytes | memoryview, dtype: str, n: int, dim: int) -> np.ndarray:
    """The (n, dim) fp32 rows of :func:`encode_rows`' bytes."""
    itemsize = 4 if dtype in ("", "float32") else 2
    if len(buf) != n * dim * itemsize:
        raise InvalidArgument(f"{len(buf)} bytes of {dtype or 'float32'} rows for {n} x {dim}")
    if dtype in ("", "float32"):
        return np.frombuffer(buf, dtype=np.float32).reshape(n, dim)
    if dtype == "float16":
        return np.frombuffer(buf, dtype=np.float16).astype(np.float32).reshape(n, dim)
    if dtype == "bfloat16":
        half = np.frombuffer(buf, dtype=np.uint16).astype(np.uint32) << np.uint32(16)
        return half.view(np.float32).reshape(n, dim)
    raise InvalidArgument(f"unknown row dtype {dtype!r}; known: float32, float16, bfloat16")


def ids_from(buf: bytes | memoryview, count: int) -> np.ndarray:
    """``count`` int64 ids from raw bytes, checked to be exactly that many."""
    if not 0 <= count <= MAX_LOOKUP_IDS or len(buf) != 8 * count:
        raise InvalidArgument(f"a lookup of {count} ids in {len(buf)} bytes (8 bytes an id, at most "
                              f"{MAX_LOOKUP_IDS} ids)")
    return np.frombuffer(buf, dtype=np.int64, count=count)


def specs_to_json(specs: Sequence[dict[str, Any]]) -> str:
    return json.dumps(list(specs), sort_keys=True)


def specs_from_json(text: str) -> list[dict[str, Any]]:
    """The table declarations an Init carries; not a list of objects with a name is InvalidArgument."""
    if not text:
        return []
    try:
        specs = json.loads(text)
    except ValueError as exc:
        raise InvalidArgument(f"table declarations are not JSON: {exc}") from None
    if not isinstance(specs, list) or not all(isinstance(s, dict) and isinstance(s.get("name"), str) for s in specs):
        raise InvalidArgument(f"table declarations must be a list of objects with a name, got {text[:200]!r}")
    return specs


# ---------------------------------------------------------------- exported dynamic tables

ROWS_FILE_SUFFIX = ".rows.npz"


def write_rows_file(path: str, spec: dict[str, Any], ids: np.ndarray, rows: np.ndarray) -> None:
    """A dynamic table as ``shoal export`` writes it: an uncompressed ``.npz`` holding ``ids`` (int64, sorted),
    ``rows`` (fp32, one per id) and ``spec`` (the table's declaration as JSON)."""
    order = np.argsort(ids, kind="stable")
    with open(path, "wb") as f:
        np.savez(f, ids=np.ascontiguousarray(ids[order], dtype=np.int64),
                 rows=np.ascontiguousarray(rows[order], dtype=np.float32), spec=np.array(json.dumps(spec)))


class RowsFile:
    """The reader of an exported dynamic table (``<out>.<table>.rows.npz``)::

        table = RowsFile("model.pt.emb.rows.npz")
        table.spec["dim"], len(table)          # its declaration, how many rows it held
        vecs = table.lookup(np.array([42, 7]))  # the rows of these ids (KeyError for an id it never held)
        table.ids, table.rows                   # everything: sorted int64 ids, fp32 rows

    The file is plain NumPy (``np.load(path)["ids"]``, ``["rows"]``, ``["spec"]``): no shoal needed to read it.
    """

    def __init__(self, path: str):
        with np.load(path, allow_pickle=False) as z:
            missing = {"ids", "rows", "spec"} - set(z.files)
            if missing:
                raise InvalidArgument(f"{path} is not an exported table: it lacks {sorted(missing)}")
            self.ids, self.rows, self.spec = z["ids"], z["rows"], json.loads(str(z["spec"]))
        if self.rows.shape != (len(self.ids), self.spec.get("dim")):
            raise InvalidArgument(f"{path}: {self.rows.shape} rows for {len(self.ids)} ids of dim {self.spec.get('dim')}")

    def __len__(self) -> int:
        return len(self.ids)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        at = np.searchsorted(self.ids, ids)
        held = (at < len(self.ids)) & (self.ids[np.minimum(at, len(self.ids) - 1)] == ids) if len(self.ids) else \
            np.zeros(len(ids), bool)
        if not held.all():
            raise KeyError(f"id {int(ids[~held][0])} is not in the table (it was never updated, or was evicted)")
        return self.rows[at]


# ---------------------------------------------------------------- table checkpoints

TABLES_DIR = "tables"           # under the checkpoint root: each shard's table snapshot files
FULL_EVERY = 10                 # checkpoints between two full snapshots of a table (differential in between)


def snapshot_file(shard: int, version: int, table: str, kind: str) -> str:
    """Where a table partition's snapshot goes, relative to the checkpoint root."""
    return f"{TABLES_DIR}/shard-{shard:05d}/{version:012d}-{kind}-{table}.snap"


def read_chain(root: str, entry: dict[str, Any]) -> list[bytes]:
    """The snapshots a checkpointed table partition restores from (a full one, then the changes since), each
    checked against its recorded size and sha256; a missing or damaged file is InvalidArgument naming it."""
    import hashlib
    import os

    if "snapshot" in entry:                 # held inline (a backup's copy)
        return [entry["snapshot"]]
    out = []
    for f in entry.get("chain", ()):
        path = os.path.join(root, f["file"])
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError as exc:
            raise InvalidArgument(f"table snapshot {path} cannot be read ({exc.strerror}); the checkpoint "
                                  f"needs it") from None
        if len(data) != f["bytes"] or hashlib.sha256(data).hexdigest() != f["sha256"]:
            raise InvalidArgument(f"table snapshot {path} does not match its checkpoint ({len(data)} bytes)")
        out.append(data)
    if not out:
        raise InvalidArgument(f"a checkpointed table entry holds no snapshot: {sorted(entry)}")
    return out
