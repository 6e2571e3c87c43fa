"""A chief that lost its journal while the job's servers live: they refuse it, and it learns it from them."""
import os

from shoal.settings.config import JobConfig
from shoal.errors import EXIT_REFUSED
from harness import InProcessCluster, wait_until


def test_servers_refuse_a_chief_that_came_back_without_the_journal_and_the_chief_stops_too(tmp_path):
    path = tmp_path / "chief.db"
    c = InProcessCluster(2, JobConfig(num_shards=2, lease_seconds=1.0), journal=str(path))
    try:
        job = c.chief.state.job_id
        assert {s.chief.job_id for s in c.servers} == {job}
        c.stop_chief()
        for suffix in ("", "-wal", "-shm", ".job"):       # the whole run directory's chief files are gone
            if os.path.exists(f"{path}{suffix}"):
                os.remove(f"{path}{suffix}")
        chief = c.start_chief()
        assert chief.state.job_id != job                  # a new job: nothing said it was not one
        wait_until(lambda: all(s.gave_up.is_set() for s in c.servers), timeout_s=30,
                   what="every server to refuse the new chief")
        for s in c.servers:
            assert s.gave_up_code == EXIT_REFUSED
            assert job in s.gave_up_reason and chief.state.job_id in s.gave_up_reason
            assert "\n" not in s.gave_up_reason
        wait_until(chief.failed.is_set, timeout_s=10, what="the chief to stop")
        assert job in chief.servicer.lost_journal and str(path) in chief.servicer.lost_journal
        assert chief.state.members.alive() == []          # it followed no one and no one followed it
    finally:
        c.stop()
