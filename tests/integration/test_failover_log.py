"""The old primary's line after its shard moved: a planned move says so, a failover (it was expired) does not."""
import logging

from shoal.proto import shoal_pb2 as pb
from test_fencing import primary  # noqa: F401 - the fixture: ps-a primary of shard 0, ps-b its backup in sync


def _promoted(h, in_view: bool) -> None:
    h.set_view(h.live_workers, 0, [pb.ShardRoute(shard=0, primary_id="ps-b", primary_address="127.0.0.1:2")],
               in_view=in_view)


def test_an_old_primary_the_chief_expired_does_not_call_the_failover_a_planned_move(primary, caplog):  # noqa: F811
    h, shard = primary("async")
    with caplog.at_level(logging.INFO, logger="shoal.ps.host"):
        _promoted(h, in_view=False)          # woke from a pause: the chief had expired it and promoted ps-b
    assert "planned move" not in caplog.text
    assert [r for r in caplog.records if r.levelno == logging.WARNING and "dropping this copy" in r.getMessage()]


def test_a_primary_still_in_the_view_hands_its_shard_over_as_a_planned_move(primary, caplog):  # noqa: F811
    h, shard = primary("async")
    with caplog.at_level(logging.INFO, logger="shoal.ps.host"):
        _promoted(h, in_view=True)
    assert "(a planned move)" in caplog.text
