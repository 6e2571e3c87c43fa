"""Properties of a table partition over random streams (hypothesis): a primary and a replica fed the same
updates (the replica in another order within each batch, the primary serving lookups in between) agree;
full + incremental snapshots restore the live table, which then goes on exactly as the original; a table's
export is the lookup of every id."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from shoal.errors import InvalidArgument
from shoal.ps.tables import RowTable, TableSnapshot, TableSpec

DIM = 3
FIXED = 48
BIG = [2**40 + 7, -(2**62), 2**63 - 1]

ids_st = st.lists(st.one_of(st.integers(0, FIXED - 1), st.sampled_from(BIG)), min_size=0, max_size=12, unique=True)
op_st = st.one_of(
    st.tuples(st.just("apply"), ids_st, st.integers(0, 2**32 - 1)),
    st.tuples(st.just("apply"), ids_st, st.integers(0, 2**32 - 1)),
    st.tuples(st.just("bad"), ids_st.filter(bool), st.integers(0, 2**32 - 1)),
    st.tuples(st.just("evict")),
    st.tuples(st.just("snap")),
)
spec_st = st.builds(
    lambda opt, fixed, after, min_count, seed: TableSpec(
        "p", DIM, FIXED if fixed else None, opt, {}, init_std=0.5, seed=seed,
        evict_after_steps=after, evict_min_count=min_count),
    st.sampled_from(["sgd", "adagrad", "adam", "ftrl"]), st.booleans(),
    st.one_of(st.none(), st.integers(1, 4), st.integers(1, 4)), st.sampled_from([0, 0, 2]),
    st.integers(0, 2**64 - 1))


def run(spec, ops):
    primary, replica = RowTable(spec, 0, 1), RowTable(spec, 0, 1)
    chain, prev = [], None
    step = 0
    for op in ops:
        kind = op[0]
        if kind in ("apply", "bad"):
            ids = np.array([i for i in op[1] if not (spec.num_embeddings and not 0 <= i < FIXED)], np.int64)
            rng = np.random.default_rng(op[2])
            g = rng.standard_normal((ids.size, DIM)).astype(np.float32)
            if kind == "bad" and ids.size:
                g[rng.integers(ids.size), rng.integers(DIM)] = np.inf
            perm = rng.permutation(ids.size)
            step += 1
            if op[2] % 3:                     # the primary serves pulls (lookups) too; they change nothing
                primary.lookup(ids[: 1 + op[2] % max(1, ids.size)])
            for table, order in ((primary, np.arange(ids.size)), (replica, perm)):
                if kind == "bad" and ids.size:
                    with pytest.raises(InvalidArgument, match="non-finite gradient"):
                        table.apply(ids[order], g[order], step)
                else:
                    table.apply(ids[order], g[order], step)
        elif kind == "evict":
            assert primary.evict(step) == replica.evict(step)
        else:
            m = primary.mark()
            snap = primary.snapshot(prev)
            chain.append(TableSnapshot.from_bytes(snap.to_bytes()))
            prev = m
        assert primary.rows == replica.rows
    return primary, replica, chain, prev, step


@settings(max_examples=50, deadline=None)
@given(spec=spec_st, ops=st.lists(op_st, max_size=25))
def test_primary_and_replica_fed_the_same_stream_agree(spec, ops):
    primary, replica, _, _, _ = run(spec, ops)
    assert primary.digest() == replica.digest()
    probe = np.array(sorted({i for op in ops if op[0] in ("apply", "bad") for i in op[1]} | {1, 2}), np.int64)
    if spec.num_embeddings:
        probe = probe[(probe >= 0) & (probe < FIXED)]
    np.testing.assert_array_equal(primary.lookup(probe), replica.lookup(probe))


@settings(max_examples=50, deadline=None)
@given(spec=spec_st, ops=st.lists(op_st, max_size=25), more=st.lists(ids_st, min_size=1, max_size=3))
def test_full_plus_incrementals_restore_the_live_table(spec, ops, more):
    primary, _, chain, prev, step = run(spec, ops)       # the first "snap" of the stream is a full one
    m = primary.mark()
    chain.append(primary.snapshot(prev))
    differential = [chain[0], primary.snapshot(chain[0].upto)]      # a full one and everything since it
    copies = []
    for snaps in (chain, differential):
        copy = RowTable(spec, 0, 1)
        copy.restore(snaps)
        assert copy.digest() == primary.digest()
        copies.append(copy)
    # the restored copies go on exactly as the original (counts, last steps, optimizer steps came back)
    for k, ids in enumerate(more):
        ids = np.array([i for i in ids if not (spec.num_embeddings and not 0 <= i < FIXED)], np.int64)
        g = np.random.default_rng(k).standard_normal((ids.size, DIM)).astype(np.float32)
        for t in (primary, *copies):
            t.apply(ids, g, step + 1 + k)
            t.evict(step + 1 + k)
    assert {c.digest() for c in copies} == {primary.digest()}
    # and their next incremental carries what changed after the restore only
    for c in copies:
        assert set(c.snapshot(m).ids.tolist()) == set(primary.snapshot(m).ids.tolist())


@settings(max_examples=50, deadline=None)
@given(spec=spec_st, ops=st.lists(op_st, max_size=15))
def test_export_equals_lookups_of_every_id(spec, ops):
    primary, _, _, _, _ = run(spec, ops)
    ids, rows = primary.export()
    if spec.num_embeddings:
        np.testing.assert_array_equal(ids, np.arange(FIXED))
    else:
        assert ids.tolist() == sorted(primary.snapshot(None).ids.tolist())
    np.testing.assert_array_equal(rows, primary.lookup(ids))
    chunks = list(primary.iter_export(chunk_rows=5))
    np.testing.assert_array_equal(np.concatenate([c[0] for c in chunks]) if chunks else ids[:0], ids)
