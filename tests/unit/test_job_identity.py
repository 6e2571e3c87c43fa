"""A job knows who it is: an id made once, journaled, in every view; a lost journal is refused, never a silent new job."""
import os
import time

import grpc
import pytest

from shoal.chief.identity import JournalLost, marker_path, read_marker
from shoal.chief.journal import JournalUnreadable
from shoal.chief.server import ChiefServer
from shoal.chief.servicer import ChiefServicer
from shoal.chief.state import ChiefState
from shoal.chief_client import ChiefClient
from shoal.settings.config import JobConfig
from shoal.errors import EXIT_REFUSED
from shoal.proto import shoal_pb2 as pb


def _chief(path, **kw) -> ChiefServer:
    return ChiefServer(JobConfig(num_shards=1), bind="127.0.0.1:0", journal=path, **kw)


def test_the_job_id_is_made_once_journaled_and_a_recovered_chief_is_the_next_generation(tmp_path):
    s = ChiefState(JobConfig(num_shards=1), time.monotonic)
    assert s.job_id.startswith("job-") and s.generation == 1
    assert ChiefState(JobConfig(num_shards=1), time.monotonic).job_id != s.job_id
    again = ChiefState.from_dict(s.to_dict(), time.monotonic, recover=True)
    assert (again.job_id, again.generation) == (s.job_id, 2)
    view = again.view()
    assert (view.job_id, view.generation) == (s.job_id, 2)
    old = s.to_dict()
    del old["job_id"], old["generation"]            # a journal from before job ids: it gets one
    assert ChiefState.from_dict(old, time.monotonic, recover=True).job_id.startswith("job-")


def test_a_restarted_chief_keeps_the_job_id_and_a_vanished_or_emptied_journal_is_refused(tmp_path):
    path = tmp_path / "chief.db"
    first = _chief(path).start()
    job = first.state.job_id
    first.stop(grace_s=0)
    assert read_marker(path)["job_id"] == job
    again = _chief(path).start()
    assert (again.state.job_id, again.state.generation) == (job, 2)
    again.stop(grace_s=0)
    for lose in ("remove", "empty"):
        for suffix in ("-wal", "-shm"):
            if os.path.exists(f"{path}{suffix}"):
                os.remove(f"{path}{suffix}")
        if lose == "remove":
            path.unlink()
        else:
            path.write_bytes(b"")
        with pytest.raises(JournalLost) as err:
            _chief(path)
        msg = str(err.value)
        assert "\n" not in msg and job in msg and str(path) in msg and "--fresh" in msg
        assert err.value.exit_code == EXIT_REFUSED
    fresh = _chief(path, fresh=True).start()      # on purpose: a new job, the old journal and marker set aside
    assert fresh.state.job_id != job and fresh.state.generation == 1
    fresh.stop(grace_s=0)
    assert read_marker(path)["job_id"] == fresh.state.job_id
    assert read_marker(f"{path}.bak")["job_id"] == job


def test_a_corrupt_marker_is_one_line_naming_it(tmp_path):
    path = tmp_path / "chief.db"
    marker_path(path).write_text("{not json")
    with pytest.raises(JournalUnreadable) as err:
        _chief(path)
    assert "\n" not in str(err.value) and str(marker_path(path)) in str(err.value)


class Refusal(Exception):
    pass


class Context:
    """What the servicer's error mapping calls: ``abort`` with the status and the one-line details."""

    def __init__(self):
        self.aborted = None

    def peer(self):
        return "test"

    def abort(self, code, details):
        self.aborted = (code, details)
        raise Refusal(details)


def test_a_chief_on_a_new_journal_refuses_members_of_another_job_and_learns_its_journal_was_lost(tmp_path):
    svc = ChiefServicer(ChiefState(JobConfig(num_shards=1), time.monotonic))
    ours = svc.Join(pb.JoinRequest(role=pb.PS, address="h:1", job_id=svc.state.job_id), None)
    assert ours.view.job_id == svc.state.job_id and ours.view.generation == 1
    ctx = Context()
    with pytest.raises(Refusal) as err:
        svc.Join(pb.JoinRequest(role=pb.PS, address="h:2", job_id="job-0ld", generation=3), ctx)
    assert ctx.aborted[0] is grpc.StatusCode.FAILED_PRECONDITION    # a member takes it as a refusal for good
    assert "job-0ld" in str(err.value) and svc.state.job_id in str(err.value)
    assert svc.lost_journal == ""               # a chief that did not start on an empty journal goes on
    svc.new_journal = str(tmp_path / "chief.db")
    with pytest.raises(Refusal):
        svc.Join(pb.JoinRequest(role=pb.WORKER, job_id="job-0ld", generation=3), Context())
    assert "job-0ld" in svc.lost_journal and str(tmp_path / "chief.db") in svc.lost_journal
    assert "\n" not in svc.lost_journal


def _view(job_id: str, generation: int, epoch: int) -> pb.ClusterView:
    return pb.ClusterView(job_id=job_id, generation=generation, epoch=epoch)


def test_a_member_follows_its_own_job_a_newer_generation_even_lower_and_refuses_another_job():
    refused: list[str] = []
    c = ChiefClient("127.0.0.1:1", pb.PS, on_refused=refused.append)
    try:
        c.job_id = "job-a"
        c._set_view(_view("job-a", 1, 40))
        c._set_view(_view("job-a", 1, 39))               # an older view of the same chief: ignored
        assert c.view.epoch == 40
        c._set_view(_view("job-a", 2, 7))                # a recovered chief that lost its last writes
        assert (c.view.generation, c.view.epoch) == (2, 7)
        c._set_view(_view("job-b", 1, 100))              # another job: refused, once, never followed
        c._set_view(_view("job-b", 1, 101))
        assert c.view.job_id == "job-a"
        assert len(refused) == 1 and "job-b" in refused[0] and "job-a" in refused[0] and "\n" not in refused[0]
        assert c.refused
    finally:
        c.close()


def test_a_watch_from_another_generation_is_answered_at_once():
    svc = ChiefServicer(ChiefState(JobConfig(num_shards=1), time.monotonic))
    assert svc.after_epoch(pb.ViewRequest(after_epoch=50, generation=1)) == 50
    assert svc.after_epoch(pb.ViewRequest(after_epoch=50)) == 50        # a member that knows no generation
    assert svc.after_epoch(pb.ViewRequest(after_epoch=50, generation=7)) == -1
    stats = svc.GetJobStats(pb.Empty(), None)        # shoal status and the run summary name the job
    assert (stats.job_id, stats.generation) == (svc.state.job_id, 1)


def test_a_corrupt_page_inside_the_journal_is_one_line(tmp_path):
    """SQLite's integrity report spans a line per problem (101 lines for one bad page): the error is one."""
    import sqlite3

    path = tmp_path / "chief.db"
    c = _chief(path).start()
    with c.servicer.lock:
        c.state.metrics.update({f"m{i}": float(i) for i in range(3000)})       # a journal of several pages
    c.servicer.save("bulk")
    c.stop(grace_s=0)
    db = sqlite3.connect(path)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    data = bytearray(path.read_bytes())
    data[2 * 4096 + 100:2 * 4096 + 2000] = b"\x5a" * 1900                     # garbage inside page 3
    path.write_bytes(bytes(data))
    with pytest.raises(JournalUnreadable) as err:
        _chief(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value) and "--fresh" in str(err.value)
