"""``shoal export`` of embedding tables: a fixed table into the ``state_dict``, a dynamic one as a file.

A checkpoint's shard file holds, for each table, the partition that shard held (its spec and a
snapshot of its rows, ``extra["tables"]``; see ps/shard_tables.py). Export rebuilds each
partition with :class:`shoal.ps.tables.RowTable` and joins them:

- a fixed table (``num_embeddings`` set) becomes ``<table>.weight`` of shape ``(num_embeddings, dim)``,
  every row there (rows never updated take their initial value, a pure function of the table's seed
  and the id), so a model built with ``nn.Embedding``/``nn.EmbeddingBag`` of the same name loads the
  file with ``load_state_dict(strict=True)``;
- a dynamic table (any int64 id) is written next to the output as ``<out>.<table>.rows.npz``, read by
  :class:`shoal.state.tables.RowsFile` (or plain ``np.load``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from shoal.state.checkpoint import Checkpoint
from shoal.state.tables import ROWS_FILE_SUFFIX, read_chain, write_rows_file


def saved_tables(ckpt: Checkpoint) -> dict[str, list[tuple[int, dict[str, Any]]]]:
    """table -> [(saved shard, its saved entry: spec, num_shards, snapshot)] over the checkpoint's shard files."""
    out: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for k in range(ckpt.num_shards):
        for name, entry in (ckpt.shard_extra(k).get("tables") or {}).items():
            out.setdefault(name, []).append((k, entry))
    return out


def table_rows(parts: list[tuple[int, dict[str, Any]]], root: str) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    """A table's spec, and the (ids, rows) its partitions hold, joined (snapshot files under ``root``)."""
    from shoal.ps.tables import RowTable, TableSnapshot, TableSpec

    spec = TableSpec.from_dict(parts[0][1]["spec"])
    ids, rows = [], []
    for k, entry in parts:
        t = RowTable(spec, k, int(entry["num_shards"]))
        t.restore([TableSnapshot.from_bytes(b) for b in read_chain(root, entry)])
        i, r = t.export()
        ids.append(i)
        rows.append(r)
    return spec.to_dict(), np.concatenate(ids), np.concatenate(rows)


def export_tables(ckpt: Checkpoint, state: dict, out: Path) -> list[str]:
    """Adds each fixed table to ``state`` and writes each dynamic one beside ``out``; returns what it did."""
    import torch

    from shoal.ps.tables import initial_rows

    done = []
    for name, parts in sorted(saved_tables(ckpt).items()):
        spec, ids, rows = table_rows(parts, str(Path(ckpt.path).parent))
        n = spec["num_embeddings"]
        if n is None:
            path = f"{out}.{name}{ROWS_FILE_SUFFIX}"
            write_rows_file(path, spec, ids, rows)
            done.append(f"table {name}: {len(ids):,} rows x {spec['dim']} to {path}")
            continue
        weight = initial_rows(spec["seed"], np.arange(n, dtype=np.int64), spec["dim"], spec["init_std"])
        weight = np.ascontiguousarray(weight, dtype=np.float32)
        weight[ids] = rows
        state[f"{name}.weight"] = torch.from_numpy(weight)
        done.append(f"table {name}: {n:,} x {spec['dim']} as {name}.weight")
    return done
