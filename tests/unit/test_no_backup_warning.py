"""A shard that loses its backup says so once the loss lasts, not while its own server is stopping too
(the end of every healthy job, where the servers leave one after the other)."""
from __future__ import annotations

import logging

from harness import wait_until
from shoal.ps import replication
from shoal.ps.replication import Replicator


def lose_backup(shard: int) -> Replicator:
    r = Replicator(shard, lambda: "ps-0", lambda: None)
    r._target = ("ps-1", "127.0.0.1:9")          # the backup it had (no copy is sent in this test)
    r.set_target("", "")
    return r


def test_a_lasting_loss_is_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(replication, "NO_BACKUP_WARN_S", 0.05)
    caplog.set_level(logging.INFO, logger="shoal.ps.replication")
    r = lose_backup(3)
    wait_until(lambda: "shard 3: no backup" in caplog.text, timeout_s=5, what="the warning")
    assert [rec.levelname for rec in caplog.records if "no backup" in rec.message] == ["WARNING"]
    r.close()


def test_no_warning_when_the_server_stops_or_a_backup_comes_back(monkeypatch, caplog):
    monkeypatch.setattr(replication, "NO_BACKUP_WARN_S", 60.0)       # the timers never fire in this test
    caplog.set_level(logging.INFO, logger="shoal.ps.replication")
    stopping = lose_backup(1)
    stopping.close()
    stopping._warn_no_backup(stopping._generation)
    back = lose_backup(2)
    gen = back._generation
    back._target = ("ps-2", "127.0.0.1:9")       # a new backup named before the timer fired
    back._generation += 1
    back._warn_no_backup(gen)
    assert "no backup" not in caplog.text
