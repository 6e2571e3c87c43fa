"""A burst of per-shard lines: a few as they are, many folded into one (every line still at debug)."""
import logging

from shoal.loglines import log_burst


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
