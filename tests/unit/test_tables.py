"""A table partition's pure state (:class:`shoal.ps.tables.RowTable`): lazy rows, apply and its refusals,
eviction and slot reuse, incremental snapshots and restore, export, memory; and the id map under it."""
import io
import json
import struct

import numpy as np
import pytest

from shoal.errors import FailedPrecondition, InvalidArgument
from shoal.ps.tables import RowTable, TableSnapshot, TableSpec, initial_rows
from shoal.ps.tables.idmap import IdMap
from shoal.state.tables import partition_of


def grads(n, dim=4, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal((n, dim)) * scale).astype(np.float32)


def sgd(name="t", num=None, **kw):
    return RowTable(TableSpec(name, 4, num, "sgd", {"lr": 0.1}, **kw), 0, 1)


# ---------------------------------------------------------------- spec

@pytest.mark.parametrize("kw,msg", [
    (dict(dim=0), "dim must be an int >= 1, got 0"),
    (dict(num_embeddings=-3), "num_embeddings must be None .* got -3"),
    (dict(optimizer="lamb"), r"unknown row optimizer 'lamb'; known: \['adagrad', 'adam', 'ftrl', 'sgd'\]"),
    (dict(init_std=float("inf")), "init_std must be a finite float >= 0, got inf"),
    (dict(seed=-1), r"seed must be an int in \[0, 2\*\*64\), got -1"),
    (dict(evict_after_steps=0), "evict_after_steps must be None or an int >= 1, got 0"),
    (dict(evict_min_count=-1), "evict_min_count must be an int >= 0, got -1"),
    (dict(name=""), "table name must be a non-empty string, got ''"),
])
def test_spec_errors_quote_the_bad_value(kw, msg):
    args = dict(name="t", dim=4, num_embeddings=None)
    args.update(kw)
    with pytest.raises(InvalidArgument, match=msg):
        TableSpec(**args)


def test_spec_round_trips_through_a_plain_dict():
    spec = TableSpec("t", 8, 100, "adagrad", {"lr": 0.5}, init_std=0.05, seed=9, evict_after_steps=10)
    d = spec.to_dict()
    assert d["hyper"] == {"lr": 0.5} and type(d["hyper"]) is dict
    assert TableSpec.from_dict(d) == spec and hash(TableSpec.from_dict(d)) == hash(spec)
    assert len({spec, TableSpec.from_dict(d), TableSpec("t", 8, 100)}) == 2
    with pytest.raises(InvalidArgument, match=r"unknown fields \['colour'\]"):
        TableSpec.from_dict({**d, "colour": 1})


# ---------------------------------------------------------------- lazy rows

def test_lookup_of_untouched_rows_is_the_initial_value_and_stores_nothing():
    t = sgd(init_std=0.5, seed=3)
    before = t.nbytes
    ids = np.array([0, 5, -7, 2**62], np.int64)
    rows = t.lookup(ids)
    assert rows.dtype == np.float32 and rows.shape == (4, 4)
    np.testing.assert_array_equal(rows, initial_rows(3, ids, 4, 0.5))
    np.testing.assert_array_equal(rows, sgd(init_std=0.5, seed=3).lookup(ids))        # a pure function of (seed, id)
    assert not np.array_equal(rows, sgd(init_std=0.5, seed=4).lookup(ids))
    assert t.rows == 0 and not t.contains(ids).any()
    assert t.nbytes == before + 4 * (8 + 4 * 4)     # only the memo of this lookup's initial rows (a bounded cache)
    assert abs(float(initial_rows(0, np.arange(20000), 16, 0.5).std()) - 0.5) < 0.01


def test_lookups_before_an_apply_change_nothing_but_cost():
    served, plain = sgd(init_std=0.3), sgd(init_std=0.3)
    ids = np.arange(0, 3000, 3)
    for k in range(6):                             # more lookups than the memo keeps, overlapping ones
        served.lookup(ids[k * 50:k * 50 + 400])
    served.lookup(np.array([5, 1, 5]))
    for t in (served, plain):
        t.apply(ids, grads(ids.size), 1)
    assert served.digest() == plain.digest()
    np.testing.assert_array_equal(served.lookup(ids), plain.lookup(ids))


def test_initial_rows_are_pinned_bit_for_bit():
    """Untouched rows are never stored: a checkpoint restored by another version or host relies on these bits."""
    got = initial_rows(7, np.array([0, -1, 2**40]), 3, 0.5).view(np.uint32)
    assert got.tolist() == [[3176890651, 3192132337, 1057288497], [3197311203, 1049610147, 1056732052],
                            [1024104679, 1058910029, 1051663999]]


def test_initial_rows_of_odd_width_are_a_prefix_of_the_next_even_width():
    ids = np.arange(10)
    np.testing.assert_array_equal(initial_rows(1, ids, 5, 1.0), initial_rows(1, ids, 6, 1.0)[:, :5])


def test_apply_inserts_counts_and_stamps_rows():
    t = sgd(init_std=0.0)
    t.apply(np.array([3, 9]), np.ones((2, 4), np.float32), step=5)
    t.apply(np.array([9]), np.ones((1, 4), np.float32), step=6)
    np.testing.assert_allclose(t.lookup(np.array([3, 9, 4])), [[-0.1] * 4, [-0.2] * 4, [0.0] * 4], rtol=1e-6)
    count, last = t.row_meta(np.array([3, 9, 4]))
    assert count.tolist() == [1, 2, 0] and last.tolist() == [5, 6, -1]
    assert t.rows == 2 and t.step_count == 2
    t.apply(np.zeros(0, np.int64), np.zeros((0, 4), np.float32), step=7)    # an empty apply only counts a step
    assert t.step_count == 3 and t.rows == 2


def test_fixed_tables_range_check_ids():
    t = sgd(num=10)
    with pytest.raises(InvalidArgument, match=r"table 't': id 10 out of range \[0, 10\) \(1 of 3 ids\)"):
        t.lookup(np.array([0, 10, 3]))
    with pytest.raises(InvalidArgument, match=r"id -1 out of range"):
        t.apply(np.array([-1]), grads(1), 0)
    with pytest.raises(InvalidArgument, match="1-D integer array"):
        t.lookup(np.array([0.5]))


def test_refusals_change_nothing():
    t = sgd(init_std=0.1)
    t.apply(np.array([1, 2]), grads(2), 0)
    d, n = t.digest(), t.nbytes
    g = grads(3)
    g[1, 2] = np.nan
    with pytest.raises(InvalidArgument, match=r"non-finite gradient for id 7 \(1 of 3 rows\); update refused"):
        t.apply(np.array([1, 7, 8]), g, 1)
    with pytest.raises(InvalidArgument, match="id 2 appears more than once"):
        t.apply(np.array([2, 5, 2]), grads(3), 1)
    with pytest.raises(InvalidArgument, match=r"grads of shape \(2, 4\)"):
        t.apply(np.array([1, 2]), grads(2, dim=3), 1)
    # finite gradients whose update overflows fp32: rolled back, the fresh id not inserted either
    huge = np.full((2, 4), 3e38, np.float32)
    t.apply(np.array([1]), -huge[:1], 1)                     # row 1 near +3e37: fine
    d, n = t.digest(), t.nbytes
    with pytest.raises(InvalidArgument, match=r"non-finite row or optimizer state for id 1 .*rolled back"):
        t.apply(np.array([1, 99]), -huge, 2, hyper={"lr": 10.0})
    assert t.digest() == d and t.nbytes == n and not t.contains(np.array([99]))[0] and t.step_count == 2


def test_prepare_changes_nothing_and_commit_stores_it_once():
    a, b = sgd(init_std=0.2), sgd(init_std=0.2)
    for t in (a, b):
        t.apply(np.array([1, 2]), grads(2), 0)
    d = a.digest()
    p = a.prepare(np.array([2, 3]), grads(2, seed=1), 1)
    assert a.digest() == d and a.rows == 2
    with pytest.raises(InvalidArgument, match="non-finite gradient"):
        a.prepare(np.array([4]), np.full((1, 4), np.nan, np.float32), 1)
    a.commit(p)
    b.apply(np.array([2, 3]), grads(2, seed=1), 1)
    assert a.digest() == b.digest() != d
    with pytest.raises(FailedPrecondition, match="prepared on only"):
        a.commit(p)                                     # twice
    stale = a.prepare(np.array([5]), grads(1), 2)
    a.apply(np.array([6]), grads(1), 2)
    with pytest.raises(FailedPrecondition, match="prepared on only"):
        a.commit(stale)                                 # the table changed since
    with pytest.raises(FailedPrecondition, match="prepared on only"):
        b.commit(a.prepare(np.array([5]), grads(1), 3))  # another table
    before_restore = a.prepare(np.array([5]), grads(1), 3)
    a.restore([a.snapshot(None)])
    with pytest.raises(FailedPrecondition, match="prepared on only"):
        a.commit(before_restore)


def test_adagrad_state_overflow_is_rolled_back():
    t = RowTable(TableSpec("a", 2, None, "adagrad", {}), 0, 1)
    t.apply(np.array([4]), np.full((1, 2), 1e19, np.float32), 0)        # sum 1e38: finite
    d = t.digest()
    with pytest.raises(InvalidArgument, match="non-finite row or optimizer state for id 4"):
        t.apply(np.array([4]), np.full((1, 2), 2e19, np.float32), 1)    # sum would overflow
    assert t.digest() == d


# ---------------------------------------------------------------- eviction

def test_eviction_by_age_and_by_count_reuses_slots():
    t = RowTable(TableSpec("d", 4, None, "adagrad", {}, evict_after_steps=5, evict_min_count=2), 0, 1)
    t.apply(np.array([1, 2, 3]), grads(3), 0)
    t.apply(np.array([1, 2]), grads(2), 4)
    t.apply(np.array([1]), grads(1), 8)
    assert t.evict(10) == 2         # 3: one update (< 2); 2: last updated at 4, 10 - 4 > 5; 1: kept
    assert t.contains(np.array([1, 2, 3])).tolist() == [True, False, False]
    np.testing.assert_array_equal(t.lookup(np.array([3])), initial_rows(0, np.array([3]), 4, 1.0))
    used = t._used
    t.apply(np.array([50, 51]), grads(2), 10)                # new rows take the freed slots
    assert t._used == used and t.rows == 3
    count, _ = t.row_meta(np.array([50, 51]))
    assert count.tolist() == [1, 1]


def test_eviction_age_rule_alone():
    t = RowTable(TableSpec("d", 4, None, "sgd", {}, evict_after_steps=5), 0, 1)
    t.apply(np.array([1, 2]), grads(2), 0)
    t.apply(np.array([2]), grads(1), 3)
    assert t.evict(5) == 0          # 5 - 0 = 5 is not more than 5
    assert t.evict(6) == 1          # row 1 last updated at 0: 6 steps ago
    assert t.contains(np.array([1, 2])).tolist() == [False, True]
    assert sgd().evict(100) == 0    # no policy: nothing goes


# ---------------------------------------------------------------- snapshots

def test_incremental_snapshot_carries_changes_and_deletions_only():
    t = RowTable(TableSpec("d", 4, None, "adam", {}, evict_after_steps=2), 0, 1)
    t.apply(np.arange(100), grads(100), 0)
    m0 = t.mark()
    full = t.snapshot(None)
    assert full.full and full.ids.size == 100 and full.upto == m0
    t.apply(np.array([5, 200]), grads(2), 1)
    t.apply(np.array([5]), grads(1), 4)
    assert t.evict(4) == 100        # 0..99 but 5 last at 0; 200 at 1: 4 - 1 > 2
    inc = t.snapshot(m0)
    assert inc.ids.tolist() == [5] and inc.deleted.size == 100 and 200 in inc.deleted and 5 not in inc.deleted
    # one row of 4 with its two moments and counters, and 8 bytes per deleted id
    assert inc.nbytes == 8 + 3 * 16 + 8 + 8 + 100 * 8 < full.nbytes // 4
    back = RowTable(t.spec, 0, 1)
    back.restore([TableSnapshot.from_bytes(full.to_bytes()), TableSnapshot.from_bytes(inc.to_bytes())])
    assert back.digest() == t.digest() and back.step_count == 3
    np.testing.assert_array_equal(back.lookup(np.arange(300)), t.lookup(np.arange(300)))
    # deletions older than a mark can be forgotten once a full snapshot covers them
    m1 = t.mark()
    t.forget_deletions(m1)
    assert t.snapshot(m0).deleted.size == 0


def test_restore_refuses_a_chain_that_does_not_fit_and_changes_nothing():
    t = sgd()
    t.apply(np.array([1]), grads(1), 0)
    m0 = t.mark()
    full = t.snapshot(None)
    t.apply(np.array([2]), grads(1), 1)
    m1 = t.mark()
    t.apply(np.array([3]), grads(1), 2)
    late = t.snapshot(m1)
    other = sgd()
    other.apply(np.array([9]), grads(1), 0)
    d = other.digest()
    with pytest.raises(FailedPrecondition, match="a full snapshot first"):
        other.restore([late])
    gap = rf"changes since mark {m1}, up to {m1}\) does not follow .*up to mark {m0}\)"
    with pytest.raises(FailedPrecondition, match=gap):
        other.restore([full, late])                  # the changes between m0 and m1 would be lost
    with pytest.raises(FailedPrecondition, match="is of another table: dim 4, this one 3"):
        RowTable(TableSpec("t", 3, None), 0, 1).restore([full])
    with pytest.raises(InvalidArgument, match="since_mark must be a mark this table issued"):
        t.snapshot(17)
    assert other.digest() == d
    other.restore([full, t.snapshot(m0)])
    assert other.digest() == t.digest()
    assert m0 < m1


def test_snapshot_bytes_are_checked():
    with pytest.raises(InvalidArgument, match="not a table snapshot"):
        TableSnapshot.from_bytes(b"PK\x03\x04" + bytes(20))
    t = sgd()
    t.apply(np.array([1, 2]), grads(2), 0)
    data = t.snapshot(None).to_bytes()
    with pytest.raises(InvalidArgument, match="table snapshot truncated: array 'state|table snapshot truncated"):
        TableSnapshot.from_bytes(data[:-1])
    assert TableSnapshot.from_bytes(data).ids.tolist() == [1, 2]
    head = json.dumps({"spec": {}, "partition": 0, "num_partitions": 1, "since": None, "upto": 0, "t": 0,
                       "arrays": []}).encode()
    with pytest.raises(InvalidArgument, match=r"lacks the arrays \['count', 'deleted', 'ids'"):
        TableSnapshot.from_bytes(b"SHTS" + struct.pack("<II", 1, len(head)) + head)
    f = io.BytesIO()
    assert t.snapshot(None).write_to(f) == len(data) and f.getvalue() == data


# ---------------------------------------------------------------- partitions, export, memory

def test_partitions_hold_their_own_ids_and_export_covers_a_fixed_table_once():
    spec = TableSpec("f", 4, 1000, "sgd", {"lr": 1.0}, seed=5)
    parts = [RowTable(spec, p, 3) for p in range(3)]
    ids = np.arange(1000)
    owner = partition_of(ids, 3)
    with pytest.raises(InvalidArgument, match="belongs to another partition than 0 of 3"):
        parts[0].lookup(ids[owner == 1][:2])
    for p, t in enumerate(parts):
        mine = ids[owner == p][:7]
        t.apply(mine, np.ones((mine.size, 4), np.float32), 0)
    got_ids = np.concatenate([t.export()[0] for t in parts])
    got_rows = np.concatenate([t.export()[1] for t in parts])
    order = np.argsort(got_ids)
    assert (got_ids[order] == ids).all()
    expect = initial_rows(5, ids, 4, 1.0)
    touched = np.concatenate([ids[owner == p][:7] for p in range(3)])
    expect[touched] -= 1.0
    np.testing.assert_array_equal(got_rows[order], expect)


def test_growth_keeps_every_row_and_memory_follows_stored_rows():
    t = RowTable(TableSpec("g", 16, 2**40, "adagrad", {}), 0, 1)
    rng = np.random.default_rng(0)
    ref = {}
    for step in range(6):
        ids = np.unique(rng.integers(0, 2**40, 3000))
        g = grads(ids.size, 16, step)
        t.apply(ids, g, step)
        for i, row in zip(ids.tolist(), g):
            ref[i] = ref.get(i, 0) + 1
    assert t.rows == len(ref)
    # one fp32 row + one fp32 accumulator of 16, plus bookkeeping
    assert t.bytes_per_row == 2 * 16 * 4 + 65
    assert t.rows * t.bytes_per_row <= t.nbytes < 3 * t.rows * t.bytes_per_row
    some = np.array(list(ref)[:500])
    count, _ = t.row_meta(some)
    assert count.tolist() == [ref[i] for i in some.tolist()]


def test_id_map_against_a_dict():
    rng = np.random.default_rng(1)
    m, ref = IdMap(), {}
    edge = np.array([-2**63, 2**63 - 1, 0, -1], np.int64)
    for it in range(120):
        ids = np.unique(np.concatenate([rng.integers(0, 5000, 300), edge if it == 0 else []]).astype(np.int64))
        found = m.find(ids)
        assert found.tolist() == [ref.get(i, -1) for i in ids.tolist()]
        if it % 3 == 2:
            gone = ids[found >= 0][::2]
            assert m.delete(gone).tolist() == [ref.pop(i) for i in gone.tolist()]
        else:
            new = ids[found < 0]
            slots = np.arange(new.size) + 10_000 * it
            m.insert(new, slots)
            ref.update(zip(new.tolist(), slots.tolist()))
        assert m.size == len(ref)
    keys, slots = m.items()
    assert dict(zip(keys.tolist(), slots.tolist())) == ref


def test_the_tables_do_not_import_torch():
    """Pure state: numpy only (a server's table partitions need no torch)."""
    import subprocess
    import sys
    code = ("import sys, numpy as np; import shoal.ps.tables as T; from shoal.state.tables import partition_of; "
            "t = T.RowTable(T.TableSpec('x', 4, None, 'adam'), 1, 2); ids = np.arange(50); "
            "mine = ids[partition_of(ids, 2) == 1]; t.apply(mine, np.ones((mine.size, 4), np.float32), 1); "
            "T.TableSnapshot.from_bytes(t.snapshot(None).to_bytes()); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
