"""shoal local's restart policy: retry crashes and signals, give up at once on exits that would repeat."""
from __future__ import annotations

import signal
import sys
import threading
from dataclasses import replace

import pytest

from shoal.cli.main import main
from shoal.cli.supervise import RestartPolicy
from shoal.errors import EXIT_REFUSED, EXIT_ROLLBACK, EXIT_UNREACHABLE, EXIT_USAGE
from shoal.proto import shoal_pb2 as pb


def test_a_crash_or_a_signal_is_restarted_with_capped_backoff():
    p = RestartPolicy(max_restarts=10, backoff_s=1.0, max_backoff_s=15.0, crash_loop_s=10.0)
    delays = []
    for i in range(8):                                   # killed again and again: each time restarted
        d = p.on_exit("ps0", -signal.SIGKILL, started=100.0 * i, now=100.0 * i + 1)
        assert d.restart and not d.fatal
        delays.append(d.delay_s)
        p.restarted("ps0")
    assert delays == [1, 2, 4, 8, 15, 15, 15, 15]        # never minutes of waiting
    d = p.on_exit("worker0", 1, started=0.0, now=60.0)   # a crash long after its start
    assert d.restart


@pytest.mark.parametrize("code", [EXIT_REFUSED, EXIT_USAGE])
def test_refused_and_usage_exits_fail_the_run_at_once(code):
    d = RestartPolicy().on_exit("chief", code, started=0.0, now=300.0)
    assert not d.restart and d.fatal and str(code) in d.why


def test_the_same_quick_exit_twice_in_a_row_is_a_crash_loop():
    p = RestartPolicy(crash_loop_s=10.0)
    assert p.on_exit("worker1", 1, started=0.0, now=2.0).restart
    p.restarted("worker1")
    d = p.on_exit("worker1", 1, started=5.0, now=7.0)
    assert not d.restart and d.fatal and "crash loop" in d.why


@pytest.mark.parametrize("first,second,started", [
    (1, EXIT_UNREACHABLE, 5.0),       # a different exit
    (1, 1, -60.0),                    # the second came long after its start
    (-signal.SIGKILL, -signal.SIGKILL, 5.0),   # killed twice: a fault from outside, not a loop
])
def test_what_is_not_a_crash_loop(first, second, started):
    p = RestartPolicy(crash_loop_s=10.0)
    assert p.on_exit("ps1", first, started=0.0, now=1.0).restart
    p.restarted("ps1")
    assert p.on_exit("ps1", second, started=started, now=7.0).restart


def test_a_slow_exit_between_two_quick_ones_resets_the_loop():
    p = RestartPolicy(crash_loop_s=10.0)
    assert p.on_exit("chief", 1, 0.0, 1.0).restart
    assert p.on_exit("chief", 1, 0.0, 100.0).restart
    assert p.on_exit("chief", 1, 200.0, 201.0).restart


def test_no_restart_and_max_restarts_give_up_without_failing_the_run():
    assert not RestartPolicy(enabled=False).on_exit("ps0", 1, 0.0, 60.0).restart
    p = RestartPolicy(max_restarts=1)
    p.restarted("ps0")
    d = p.on_exit("ps0", -9, 0.0, 60.0)
    assert not d.restart and not d.fatal and "restarted 1 times" in d.why


def test_a_ps_timeout_must_be_positive(capsys):
    assert main(["ps", "--chief", "127.0.0.1:1", "--chief-timeout", "0"]) == EXIT_USAGE
    assert "--chief-timeout must be > 0 seconds, got 0.0" in capsys.readouterr().err


class FakeProc:
    def __init__(self, code=None):
        self.code = code

    def poll(self):
        return self.code


class FakeChild:
    def __init__(self, name, code=None):
        self.name, self.proc, self.started, self.last_line = name, FakeProc(code), 0.0, ""
        self.tail = []
        self._pump = threading.Thread(target=lambda: None)
        self._pump.start()

    def terminate(self):
        pass

    def stop(self):
        pass


@pytest.mark.timeout(20)
def test_a_chief_that_dies_as_the_workers_end_is_restarted_before_the_records_are_read(tmp_path):
    """Found by bench/nemesis.py (a chief and a primary killed as the workers finished): the run
    read no stats, no ledger, no final checkpoint, and reported success without its records."""
    from shoal.cli.local import LocalCluster, LocalConfig

    script = tmp_path / "train.py"
    script.write_text("")
    cluster = LocalCluster(LocalConfig(script=str(script), restart_backoff_s=0.05), out=sys.stdout)
    spawned = []

    def spawn(name, args, extra_env=None):
        spawned.append(name)
        cluster.children[name] = FakeChild(name)
        return cluster.children[name]

    cluster._spawn = spawn
    cluster.chief_address = "127.0.0.1:1"
    for name, code in (("chief", -signal.SIGKILL), ("ps0", -signal.SIGKILL), ("ps1", None),
                       ("worker0", 0), ("worker1", 0)):
        cluster.children[name] = FakeChild(name, code)
        cluster._launch[name] = ([], None)
    assert cluster.wait_workers() == {"worker0": 0, "worker1": 0}
    assert sorted(spawned) == ["chief", "ps0"]            # both back before the job's records are read


def cluster_whose_journal_says(tmp_path, state: dict, event: str, respawn_code=None):
    """A LocalCluster (no processes) over a chief journal holding ``state``; returns it and the names
    it spawns again (each as a FakeChild exiting with ``respawn_code``, workers with 0)."""
    from shoal.chief.journal import Journal
    from shoal.cli.local import LocalCluster, LocalConfig

    script = tmp_path / "train.py"
    script.write_text("")
    cluster = LocalCluster(LocalConfig(script=str(script), restart_backoff_s=0.05, run_dir=str(tmp_path / "run"),
                                       checkpoint_dir=str(tmp_path / "ckpt")), out=sys.stdout)
    journal = Journal(tmp_path / "run" / "chief.db")
    journal.write(state, event)
    journal.close()
    spawned = []

    def spawn(name, args, extra_env=None):
        spawned.append(name)
        cluster.children[name] = FakeChild(name, 0 if name.startswith("worker") else respawn_code)
        return cluster.children[name]

    cluster._spawn = spawn
    cluster.chief_address = "127.0.0.1:1"
    return cluster, spawned


def run_children(cluster, codes) -> dict:
    for name, code in codes:
        cluster.children[name] = FakeChild(name, code)
        cluster._launch[name] = ([], None)
    return cluster.wait_workers()


@pytest.mark.timeout(20)
def test_a_chief_killed_after_it_stopped_the_job_rolls_every_role_back(tmp_path):
    """Found by bench/nemesis.py --netns (seed 703): the chief stopped the job (a shard lost every copy)
    and was SIGKILLed before it exited to say so. Restarted alone, it rolled back in place from its
    journal while the servers and workers of the lost state carried on: the workers' task tokens did
    not verify at the old servers and they crash-looped until the run failed."""
    cluster, spawned = cluster_whose_journal_says(
        tmp_path, {"stopped": "shard 0 lost every copy that holds all its updates"}, "stopped")
    codes = (("chief", -signal.SIGKILL), ("ps0", None), ("ps1", None), ("worker0", None), ("worker1", None))
    assert run_children(cluster, codes) == {"worker0": 0, "worker1": 0}
    assert cluster.rollbacks == 1
    assert sorted(spawned) == ["chief", "ps0", "ps1", "worker0", "worker1"]    # every role, not the chief alone


@pytest.mark.timeout(20)
def test_a_chief_killed_on_a_running_job_is_restarted_alone(tmp_path):
    cluster, spawned = cluster_whose_journal_says(tmp_path, {"stopped": ""}, "running", respawn_code=0)
    assert run_children(cluster, (("chief", -signal.SIGKILL), ("ps0", None), ("worker0", 0))) == {"worker0": 0}
    assert spawned == ["chief"] and cluster.rollbacks == 0


def records_phase(cluster, monkeypatch, reads: list[dict]):
    """Stands in for the chief's and the servers' answers after the workers end: ``reads`` are the
    shard reports, one per read; returns the reads made so far."""
    made = []
    monkeypatch.setattr(cluster, "drain", lambda: 0)
    monkeypatch.setattr(cluster, "job_stats", lambda: pb.JobStats())
    monkeypatch.setattr(cluster, "replica_report", lambda: None)
    monkeypatch.setattr(cluster, "final_checkpoint", lambda target: target)

    def shard_report():
        made.append(reads[min(len(made), len(reads) - 1)])
        return made[-1]
    monkeypatch.setattr(cluster, "shard_report", shard_report)
    return made


UNREAD = {"shards": [{"shard": 0, "version": 43, "initialized": True, "ledger": []}, {"shard": 1, "error": "UNAVAILABLE"}]}
READ = {"shards": [{"shard": k, "version": 43, "initialized": True, "ledger": []} for k in (0, 1)]}


@pytest.mark.timeout(20)
def test_a_job_the_chief_stops_after_the_workers_ended_is_rolled_back_and_read_again(tmp_path, monkeypatch):
    """Found by bench/nemesis.py --netns (seed 1020): the chief and a primary were killed just after
    training ended; the restarted chief stopped the job once that primary's lease ran out (no whole copy
    left), after the run had read its records (a shard unread). It printed "exactly once UNKNOWN" and
    exited 0 over a lost end state, instead of running the job again from its newest checkpoint."""
    from shoal.cli.ending import finish

    cluster, spawned = cluster_whose_journal_says(tmp_path, {"stopped": ""}, "running")
    made = records_phase(cluster, monkeypatch, [UNREAD, READ])
    for name, code in (("chief", None), ("ps0", None), ("ps1", None), ("worker0", 0), ("worker1", 0)):
        cluster.children[name] = FakeChild(name, code)
        cluster._launch[name] = ([], None)
    polls = []

    def answers_whole(address):      # the chief stops the job, then exits to say so
        polls.append(address)
        cluster.children["chief"].proc.code = EXIT_ROLLBACK
        return False
    monkeypatch.setattr("shoal.cli.ending._answers_whole", answers_whole)
    end = finish(cluster, started=0.0, decide_s=10.0)
    assert cluster.rollbacks == 1 and sorted(spawned) == ["chief", "ps0", "ps1", "worker0", "worker1"]
    assert made == [UNREAD, READ] and end.shards == READ and end.codes == {"worker0": 0, "worker1": 0}


@pytest.mark.timeout(20)
def test_records_read_again_once_every_shard_answers_and_not_waited_for_under_fast_recovery(tmp_path, monkeypatch):
    from shoal.cli.ending import finish

    cluster, spawned = cluster_whose_journal_says(tmp_path, {"stopped": ""}, "running")
    made = records_phase(cluster, monkeypatch, [UNREAD, READ])
    for name, code in (("chief", None), ("ps0", None), ("worker0", 0)):
        cluster.children[name] = FakeChild(name, code)
        cluster._launch[name] = ([], None)
    answers = iter([False, False, True])
    monkeypatch.setattr("shoal.cli.ending._answers_whole", lambda address: next(answers))
    end = finish(cluster, started=0.0, decide_s=10.0)
    assert made == [UNREAD, READ] and end.shards == READ and cluster.rollbacks == 0 and spawned == []

    made.clear()
    consistent = cluster.cfg
    monkeypatch.setattr(cluster, "cfg", replace(consistent, job=replace(consistent.job, recovery="fast")))
    assert finish(cluster, started=0.0, decide_s=10.0).shards == UNREAD and made == [UNREAD]
    made.clear()                                        # nothing doubtful: read once, no wait
    records_phase(cluster, monkeypatch, [READ])
    monkeypatch.setattr("shoal.cli.ending._answers_whole", lambda address: pytest.fail("waited on good records"))
    monkeypatch.setattr(cluster, "cfg", consistent)
    assert finish(cluster, started=0.0, decide_s=10.0).shards == READ
