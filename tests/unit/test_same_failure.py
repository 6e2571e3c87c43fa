"""A bug is not a storm: a worker that fails the same way twice is not restarted again, however long each
run lasted; a worker that fails once the job's data is done does not fail the run."""
from __future__ import annotations

import sys
import threading

import pytest

from shoal.cli.supervise import RestartPolicy, failure_signature, traceback_tail
from shoal.errors import EXIT_UNREACHABLE

BUG_AT_STEP_10 = """\
2026-12-07 17:00:01,000 INFO shoal.worker.trainer: worker worker-0 ready: 9 parameters
Traceback (most recent call last):
  File "/usr/lib/python3.11/runpy.py", line 88, in _run_code
    exec(code, run_globals)
  File "/home/u/train.py", line 41, in <module>
    main()
  File "/home/u/train.py", line 33, in main
    raise ValueError(f"bad batch at step {step}")
ValueError: bad batch at step 10
"""


def test_the_signature_is_the_exception_type_and_its_innermost_line_else_the_exit_code():
    assert failure_signature(1, BUG_AT_STEP_10.splitlines()) == "ValueError at /home/u/train.py:33"
    other_message = BUG_AT_STEP_10.replace("step 10", "step 11").splitlines()
    assert failure_signature(1, other_message) == "ValueError at /home/u/train.py:33"
    elsewhere = BUG_AT_STEP_10.replace("line 33", "line 34").splitlines()
    assert failure_signature(1, elsewhere) != failure_signature(1, BUG_AT_STEP_10.splitlines())
    assert failure_signature(137, ["killed"]) == "exit 137"
    chained = BUG_AT_STEP_10 + "\nDuring handling of the above exception, another exception occurred:\n\n" + \
        'Traceback (most recent call last):\n  File "/home/u/train.py", line 50, in main\n    x.item()\n' \
        "UnboundLocalError: cannot access local variable 'loss'\n"
    assert failure_signature(1, chained.splitlines()) == "UnboundLocalError at /home/u/train.py:50"
    assert traceback_tail(BUG_AT_STEP_10.splitlines(), 2) == \
        '    raise ValueError(f"bad batch at step {step}")\nValueError: bad batch at step 10'


def test_the_same_failure_twice_is_not_restarted_whatever_its_run_time():
    p = RestartPolicy(crash_loop_s=30.0)
    sig = failure_signature(1, BUG_AT_STEP_10.splitlines())
    assert p.on_exit("worker0", 1, started=0.0, now=40.0, signature=sig).restart      # slow: not a crash loop
    p.restarted("worker0")
    d = p.on_exit("worker0", 1, started=45.0, now=90.0, signature=sig)
    assert not d.restart and d.fatal and "the same way twice" in d.why and "ValueError" in d.why


@pytest.mark.parametrize("first,second", [
    ("ValueError at /t.py:33", "KeyError at /t.py:33"),        # another bug
    ("ValueError at /t.py:33", "ValueError at /t.py:40"),      # another line
    ("exit 1", "exit 2"),
])
def test_a_different_failure_is_restarted(first, second):
    p = RestartPolicy(crash_loop_s=30.0)
    assert p.on_exit("worker0", 1, 0.0, 40.0, first).restart
    assert p.on_exit("worker0", 1, 45.0, 90.0, second).restart


def test_an_unreachable_peer_or_a_signal_twice_is_still_restarted():
    p = RestartPolicy(crash_loop_s=30.0)
    for _ in range(2):
        assert p.on_exit("worker0", EXIT_UNREACHABLE, 0.0, 40.0, f"exit {EXIT_UNREACHABLE}").restart
    for _ in range(2):
        assert p.on_exit("worker0", -9, 0.0, 40.0, "exit -9").restart


class _Proc:
    def __init__(self, code):
        self.code = code

    def poll(self):
        return self.code


class _Child:
    def __init__(self, name, code, lines=()):
        self.name, self.proc, self.started, self.last_line = name, _Proc(code), 0.0, (list(lines) or [""])[-1]
        self.tail = list(lines)
        self._pump = threading.Thread(target=lambda: None)
        self._pump.start()

    def terminate(self):
        pass

    def stop(self):
        pass


def _cluster(tmp_path, data_done: bool):
    from shoal.cli.local import LocalCluster, LocalConfig

    script = tmp_path / "train.py"
    script.write_text("")
    cluster = LocalCluster(LocalConfig(script=str(script), restart_backoff_s=0.0), out=sys.stdout)
    cluster.chief_address = "127.0.0.1:1"
    cluster._data_done = lambda: data_done
    cluster._spawn = lambda name, args, extra_env=None: cluster.children.setdefault(
        name, _Child(name, 1, BUG_AT_STEP_10.splitlines()))
    return cluster


@pytest.mark.timeout(20)
def test_a_worker_failing_after_the_jobs_data_is_done_does_not_fail_the_run(tmp_path):
    cluster = _cluster(tmp_path, data_done=True)
    cluster.children["worker0"] = _Child("worker0", 0)
    cluster.children["worker1"] = _Child("worker1", 1, BUG_AT_STEP_10.splitlines())
    assert cluster.wait_workers() == {"worker0": 0, "worker1": 1}
    assert cluster.after_data == {"worker1"} and not cluster.restarts


@pytest.mark.timeout(20)
def test_a_script_bug_stops_the_run_at_its_second_crash_with_the_scripts_error(tmp_path):
    from shoal.cli.local import JobStopped

    cluster = _cluster(tmp_path, data_done=False)
    cluster._launch["worker0"] = ([], None)
    cluster.children["worker0"] = _Child("worker0", 1, BUG_AT_STEP_10.splitlines())
    real_restart = cluster._restart

    def restart(name):            # the restarted worker fails the same way, later in its life
        del cluster.children[name]
        real_restart(name)
        cluster.children[name].started = -100.0

    cluster._restart = restart
    with pytest.raises(JobStopped) as stopped:
        cluster.wait_workers()
    assert cluster.restarts == {"worker0": 1}
    assert "failed the same way twice" in str(stopped.value)
    assert "ValueError: bad batch at step 10" in str(stopped.value) and "train.py\", line 33" in str(stopped.value)


def test_each_local_worker_gets_its_share_of_the_cores_unless_the_user_chose(caplog):
    from shoal.cli.threads import WorkerThreads, usable_cores, worker_threads

    assert worker_threads(2, cores=16) == 8 and worker_threads(4, cores=2) == 1 and worker_threads(3, cores=8) == 2
    threads = WorkerThreads(2, env={})
    with caplog.at_level("INFO", logger="shoal.cli.local"):
        first, second = threads.env(), threads.env()
    assert first == second == {"OMP_NUM_THREADS": str(max(1, usable_cores() // 2))}
    assert len([r for r in caplog.records if "intra-op thread" in r.getMessage()]) == 1      # said once
    assert WorkerThreads(2, env={"OMP_NUM_THREADS": "3"}).env() == {}


def test_two_workers_failing_with_one_traceback_stop_the_run_at_the_second():
    p = RestartPolicy(crash_loop_s=30.0)
    sig = failure_signature(1, BUG_AT_STEP_10.splitlines())
    assert p.on_exit("worker0", 1, 0.0, 40.0, sig).restart
    d = p.on_exit("worker1", 1, 0.0, 41.0, sig)
    assert not d.restart and d.fatal and "the same way as worker0" in d.why
    assert p.on_exit("worker2", 1, 0.0, 42.0, "exit 1").restart        # no traceback: per worker only
    assert p.on_exit("worker3", 1, 0.0, 43.0, "exit 1").restart


def test_the_supervisor_names_a_worker_as_the_chief_does(tmp_path):
    import io

    from shoal.cli.local import LocalCluster, LocalConfig
    from shoal.cli.progress import Console

    script = tmp_path / "train.py"
    script.write_text("")
    console = Console(io.StringIO(), interactive=False)
    cluster = LocalCluster(LocalConfig(script=str(script)), out=console)
    console.names.rewrite("[worker1] 2026-12-07 17:00:00,000 INFO shoal.chief_client: joined chief 127.0.0.1:1 "
                          "as worker-0 (view epoch 3)\n")
    assert cluster.shown("worker1") == "worker-0 (process worker1)"
    assert cluster.shown("worker0") == "worker0"          # not joined yet: the launcher's name


def test_a_worker_alone_on_its_host_uses_the_cores_it_may_run_on_unless_the_user_chose(monkeypatch):
    import torch

    from shoal.cli.threads import set_worker_threads, usable_cores

    before = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        assert set_worker_threads() is None
        monkeypatch.delenv("OMP_NUM_THREADS")
        torch.set_num_threads(max(1, usable_cores() + 3))      # as torch's default could be in a container
        assert set_worker_threads() == usable_cores() == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
