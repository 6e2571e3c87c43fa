"""The worker's hot-row cache (worker/tables.py RowCache): hits within the staleness bound, bounded size."""
import numpy as np

from shoal.worker.tables import RowCache


def rows(ids, v):
    return np.full((len(ids), 2), v, np.float32)


def test_a_row_serves_for_its_steps_then_is_pulled_again():
    c = RowCache(size=10, steps=2, dim=2)
    ids = np.array([3, 8], np.int64)
    hit, _ = c.get(ids, step=0)
    assert not hit.any()
    c.put(ids, rows(ids, 1.0), step=0)
    hit, got = c.get(np.array([1, 3, 8], np.int64), step=2)
    assert hit.tolist() == [False, True, True] and got.tolist() == [[1, 1], [1, 1]]
    hit, _ = c.get(ids, step=3)                          # pulled at 0, bound 2: stale at 3
    assert not hit.any()
    c.put(np.array([8], np.int64), rows([8], 5.0), step=3)
    hit, got = c.get(ids, step=3)
    assert hit.tolist() == [False, True] and got.tolist() == [[5, 5]]
    assert (c.hits, c.misses) == (3, 6)


def test_the_oldest_rows_leave_first_when_full():
    c = RowCache(size=3, steps=100, dim=2)
    c.put(np.array([1, 2], np.int64), rows([1, 2], 1.0), step=0)
    c.put(np.array([5, 6], np.int64), rows([5, 6], 2.0), step=1)
    assert len(c.ids) == 3 and {5, 6} <= set(c.ids.tolist())
    assert list(c.ids) == sorted(c.ids)
