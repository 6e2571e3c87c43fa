"""ssp: a worker whose first push reaches a shard before the view that names it starts level with the
slowest, as one the view named first does (tests/system/test_elastic.py[ssp] deadlocked: the late
worker's clock started at 0 on one shard and at the others' on the other, and each side waited on it)."""
from shoal.ps.consistency import SSPRule
from test_shard_mutants import ones, shard


def test_a_newcomer_pushing_before_the_view_names_it_starts_level_with_the_slowest():
    s = shard(SSPRule(2))
    s.set_live_workers({"a", "b"})
    for step in range(10):                     # a and b move the shard's clocks on to 10
        for w in ("a", "b"):
            s.push(w, s.version, ones(0), wait_s=0)
    assert s.worker_clocks() == {"a": 10, "b": 10}
    s.push("c", s.version, ones(0), wait_s=0)  # c's first push, before the view names it
    assert s.worker_clocks()["c"] == 11        # level with the slowest, then its push
    s.set_live_workers({"a", "b", "c"})        # the view that names it changes nothing
    assert s.worker_clocks() == {"a": 10, "b": 10, "c": 11}
    for w in ("a", "b"):                       # and nobody is held back by a clock it never had
        s.push(w, s.version, ones(0), wait_s=0)
    assert s.worker_clocks() == {"a": 11, "b": 11, "c": 11}


def test_a_newcomer_the_view_names_first_starts_there_too():
    s = shard(SSPRule(2))
    s.set_live_workers({"a"})
    for _ in range(5):
        s.push("a", s.version, ones(0), wait_s=0)
    s.set_live_workers({"a", "c"})
    assert s.worker_clocks() == {"a": 5, "c": 5}


def test_a_backup_that_has_not_heard_of_the_newcomer_counts_it_as_its_primary_does():
    primary, backup = shard(SSPRule(2)), shard(SSPRule(2))
    updates = []
    primary.replicator = updates.append
    for s in (primary, backup):
        s.set_live_workers({"a"})
    for _ in range(5):
        primary.push("a", primary.version, ones(0), wait_s=0)
    primary.push("c", primary.version, ones(0), wait_s=0)     # neither copy's view names c yet
    for u in updates:
        backup.apply_replica(u)
    assert backup.worker_clocks() == primary.worker_clocks() == {"a": 5, "c": 6}
