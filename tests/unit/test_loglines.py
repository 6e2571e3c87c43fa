"""A burst of per-shard lines: a few as they are, many folded into one (every line still at debug)."""
import logging

from shoal.chief.state import ChiefState
from shoal.settings.config import JobConfig
from shoal.observe.loglines import log_burst


def records(caplog, lines, **kw):
    caplog.clear()
    log_burst(logging.getLogger("shoal.test"), lines, **kw)
    return [(r.levelno, r.getMessage()) for r in caplog.records]


def test_up_to_the_limit_each_line_is_logged_as_it_is(caplog):
    caplog.set_level(logging.DEBUG, logger="shoal.test")
    lines = [f"shard {k}: backup ps-1" for k in range(4)]
    assert records(caplog, lines) == [(logging.INFO, line) for line in lines]
    assert records(caplog, []) == []


def test_a_longer_burst_is_one_line_at_its_level_and_every_line_at_debug(caplog):
    caplog.set_level(logging.DEBUG, logger="shoal.test")
    lines = [f"shard {k} -> ps-{k % 4} (placed)" for k in range(32)]
    got = records(caplog, lines, level=logging.WARNING)
    assert got[0] == (logging.WARNING, "shard 0 -> ps-0 (placed); shard 1 -> ps-1 (placed); and 30 more like them "
                                       "(debug logging lists every one)")
    assert got[1:] == [(logging.DEBUG, line) for line in lines]


def test_at_info_a_long_burst_shows_one_line(caplog):
    caplog.set_level(logging.INFO, logger="shoal.test")
    assert len(records(caplog, [f"line {i}" for i in range(5)])) == 1
    assert len(records(caplog, [f"line {i}" for i in range(5)], limit=5)) == 5


def test_a_chief_placing_many_shards_and_a_server_leaving_with_them_say_so_in_one_line_each(caplog, clock):
    caplog.set_level(logging.INFO, logger="shoal.chief.state")
    s = ChiefState(JobConfig(num_shards=16, lease_seconds=1.0), clock)
    servers = [s.join_ps(f"h:{i}")[0] for i in range(2)]
    for _ in range(3):              # past a lease since the last join (the servers beating): the rest are placed
        clock.advance(0.6)
        for p in servers:
            s.heartbeat(p.member_id)
        s.tick()
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and r.name == "shoal.chief.state"]
    assert any("and" in line and "more like them" in line for line in info), info
    assert len(info) <= 6, info     # not one line per shard
    caplog.clear()
    s.leave(servers[0].member_id)
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and r.name == "shoal.chief.state"]
    # (no backup reported a whole copy in this pure state: every shard ps-0 held leaves with it)
    assert len(info) == 1 and "its last copy left with ps-0" in info[0] and "more like them" in info[0], info


def test_a_server_leaving_with_many_copies_says_so_in_one_line(caplog):
    import torch

    from shoal.settings.config import OptimizerSpec
    from shoal.proto import shoal_pb2 as pb
    from shoal.ps.host import ShardHost

    host = ShardHost()
    host.member_id = "ps-a"
    try:
        for k in range(8):
            host.assign(k, JobConfig(mode="async", num_shards=8))
            host.create(k, torch.zeros(4), OptimizerSpec("sgd", {"lr": 1.0}), "fp")
        host.leaving = True
        caplog.set_level(logging.INFO, logger="shoal.ps.host")
        host.set_view(frozenset(), 0, [pb.ShardRoute(shard=k, primary_id="ps-b", primary_address="h:2")
                                       for k in range(8)])
        lines = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "shoal.ps.host"]
        assert len(lines) == 1 and lines[0][0] == logging.INFO, lines
        assert lines[0][1].startswith("shard 0: dropping this copy") and "and 6 more like them" in lines[0][1]
    finally:
        host.close()
