"""Embedding tables held on the parameter servers: pure state (numpy only, no sockets, no torch).

One :class:`RowTable` is one partition of one table (the rows whose id hashes to
that partition, :func:`shoal.state.tables.partition_of`), living inside the dense
shard of the same number. See ``docs/embeddings.md`` for the user's view.
"""
from shoal.ps.tables.init import initial_rows
from shoal.ps.tables.optimizers import ROW_OPTIMIZERS, RowOptimizer, register_row_optimizer, row_optimizer
from shoal.ps.tables.snapshot import TableSnapshot
from shoal.ps.tables.spec import TableSpec
from shoal.ps.tables.table import PreparedApply, RowTable

__all__ = ["PreparedApply", "ROW_OPTIMIZERS", "RowOptimizer", "RowTable", "TableSnapshot", "TableSpec", "initial_rows",
           "register_row_optimizer", "row_optimizer"]
