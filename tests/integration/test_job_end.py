"""A job that ends: once every task is done the chief says so, drains, and it and its servers are done;
a worker that comes after is turned away at once (chief/lifecycle.py)."""
import pytest

from harness import wait_until
from shoal.cli.status import collect, render
from shoal.errors import JOB_FINISHED, Refused
from shoal.worker import Trainer

from test_cluster import data, mlp, train


def test_the_chief_and_its_servers_end_on_their_own_after_the_last_task(cluster_factory):
    c = cluster_factory(num_ps=2, mode="sync", lease_seconds=1.0)
    lc = c.chief.state.lifecycle
    lc.drain_s, lc.quiet_s = 60.0, 0.5          # the drain ends early: no worker is left
    m = mlp(0)
    t = Trainer(m, chief=c.chief_address, lr=0.05)
    x, y = data(64)
    train(t, m, x, y, epochs=1)
    wait_until(lambda: lc.finished, timeout_s=20, what="the chief to mark the job finished")
    assert not c.chief.closed.is_set() and not any(ps.done.is_set() for ps in c.servers)   # draining
    s = collect(c.chief_address)
    assert s["job"]["phase"] == "finished" and s["job"]["exit_code"] == 0
    assert "finished: 1/1 tasks done" in render(s).splitlines()[0]
    t.close()                                    # the last worker leaves: the drain ends a quiet lease later
    wait_until(lambda: all(ps.done.is_set() for ps in c.servers), timeout_s=20,
               what="every server to see the job closing")
    assert [ps.job_exit_code for ps in c.servers] == [0, 0]
    for ps in c.servers:                          # what `shoal ps` does once done is set
        ps.stop(grace_s=0.5)
    wait_until(c.chief.closed.is_set, timeout_s=20, what="the chief to be free to exit")
    assert c.chief.exit_code == 0


def test_a_worker_that_joins_a_finished_job_is_turned_away(cluster_factory):
    c = cluster_factory(num_ps=1, mode="async")
    m = mlp(0)
    t = Trainer(m, chief=c.chief_address, lr=0.05)
    x, y = data(32)
    train(t, m, x, y, epochs=1)
    wait_until(lambda: c.chief.state.lifecycle.finished, timeout_s=20, what="the job to finish")
    t.close()
    with pytest.raises(Refused, match=JOB_FINISHED):
        Trainer(mlp(1), chief=c.chief_address, lr=0.05)


def test_shoal_worker_against_a_finished_job_exits_0_with_one_line(cluster_factory, tmp_path):
    import subprocess
    import sys

    c = cluster_factory(num_ps=1, mode="async")
    m = mlp(0)
    t = Trainer(m, chief=c.chief_address, lr=0.05)
    x, y = data(32)
    train(t, m, x, y, epochs=1)
    wait_until(lambda: c.chief.state.lifecycle.finished, timeout_s=20, what="the job to finish")
    t.close()
    script = tmp_path / "train.py"
    script.write_text("import torch\nfrom shoal.worker import Trainer\n"
                      "Trainer(torch.nn.Linear(8, 3), chief=None)\nraise SystemExit('trained')\n")
    done = subprocess.run([sys.executable, "-m", "shoal.cli", "--log-level", "warning", "worker", "--chief",
                           c.chief_address, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and JOB_FINISHED in lines[0], done.stderr


def test_shoal_status_piped_into_head_stops_quietly(cluster_factory):
    import subprocess
    import sys

    c = cluster_factory(num_ps=1, mode="async")
    # the reader closes the pipe after one line: no BrokenPipeError traceback, exit 0
    r = subprocess.run(f"'{sys.executable}' -m shoal.cli status --chief {c.chief_address} | head -c 1 >/dev/null; "
                       f"exit ${{PIPESTATUS[0]}}", shell=True, executable="/bin/bash", capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr

