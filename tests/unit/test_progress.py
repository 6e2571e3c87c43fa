"""What ``shoal local`` shows: prefixes that follow member names, the bar's fields, the closing lines."""
from __future__ import annotations

import io

from shoal.cli.progress import Console, MemberNames, Rate, bar_fields, result_lines, shown_on_terminal
from shoal.proto import shoal_pb2 as pb

INFO = "2026-12-03 20:08:17,040 INFO shoal.x: "
WARN = "2026-12-03 20:08:17,040 WARNING shoal.x: "


def test_a_childs_prefix_becomes_its_member_name_once_it_joins():
    names = MemberNames()
    assert names.rewrite(f"[worker1] {INFO}starting\n") == f"[worker1] {INFO}starting\n"
    assert names.rewrite(f"[worker1] {INFO}joined chief 127.0.0.1:5 as worker-0 (view epoch 1)\n") == \
        f"[worker-0] {INFO}joined chief 127.0.0.1:5 as worker-0 (view epoch 1)\n"
    assert names.rewrite(f"[worker1] {INFO}step 50 loss 0.3\n") == f"[worker-0] {INFO}step 50 loss 0.3\n"
    assert names.rewrite("[worker0] hello\n") == "[worker0] hello\n"
    assert names.get("worker1") == "worker-0"


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_only_warnings_errors_and_prints_show_and_every_line_is_logged(tmp_path):
    out = FakeTTY()
    console = Console(out)
    console.open_log(tmp_path / "shoal.log")
    console.write(f"[ps0] {INFO}joined chief 127.0.0.1:5 as ps-1 (view epoch 1)\n")
    console.write(f"[ps0] {WARN}shard 0: no backup\n")
    console.write("[worker0] Traceback (most recent call last):\n")
    console.write(f"[worker0] {INFO}step 50 loss 0.3\n")
    console.close()
    console.write(f"[ps0] {WARN}shard 1 lost its primary\n")       # teardown after the bar: log only
    console.close_log()
    assert out.getvalue() == f"[ps-1] {WARN}shard 0: no backup\n[worker0] Traceback (most recent call last):\n"
    logged = (tmp_path / "shoal.log").read_text().splitlines()
    assert len(logged) == 5 and logged[0].startswith("[ps-1] ") and "lost its primary" in logged[-1]


def test_off_a_terminal_every_line_passes_with_its_member_prefix(tmp_path):
    out = io.StringIO()
    console = Console(out)
    console.open_log(tmp_path / "shoal.log")
    console.write(f"[worker1] {INFO}joined chief 127.0.0.1:5 as worker-0 (view epoch 1)\n[worker1] {INFO}a\n")
    assert out.getvalue().splitlines() == [f"[worker-0] {INFO}joined chief 127.0.0.1:5 as worker-0 (view epoch 1)",
                                           f"[worker-0] {INFO}a"]
    assert not (tmp_path / "shoal.log").exists() and console.log_path == ""


def test_shown_on_terminal():
    assert not shown_on_terminal(f"[chief] {INFO}x")
    assert shown_on_terminal(f"[chief] {WARN}x")
    assert shown_on_terminal("[worker-0] plain print from the script")


def test_bar_fields_from_job_stats():
    stats = pb.JobStats(tasks_done=30, tasks_total=60, completed_epochs=1, epochs=3, batches_per_epoch=40,
                        workers_live=2, metrics={"train_loss": 0.4321})
    f = bar_fields(stats, 812.4)
    assert f == {"total": 120, "done": 60, "desc": "epoch 2/3", "postfix": "2 workers, 812 samples/s, loss 0.4321"}
    assert bar_fields(pb.JobStats(), None)["desc"] == "waiting for workers"


def test_rate_over_a_window():
    r = Rate(window_s=5)
    assert r.update(0, 0.0) is None
    assert r.update(100, 1.0) == 100
    for t in range(2, 12):
        rate = r.update(100 + 50 * (t - 1), float(t))
    assert rate == 50


def test_result_lines_are_few_and_name_the_files():
    summary = {"mode": "sync", "ps": 2, "workers": 2, "seconds": 20.0, "steps": 200, "samples": 6400,
               "test_accuracy": 0.9712, "test_accuracy_from": "worker-1", "exactly_once": True, "replicas_identical": True,
               "worker_exit_codes": {"worker0": 0, "worker1": 0}, "tensorboard": "runs/tb",
               "alert/loss_spike/worker-0": 12.0}
    lines = result_lines(summary, True, "runs/summary.json", "runs/shoal.log")
    assert lines[0] == "training finished in 20.0s: sync mode, 2 ps, 2 workers"
    text = "\n".join(lines)
    for part in ("test accuracy   0.9712 (worker-1)", "200 (10.0/s)", "6400 samples (320/s)", "exactly once    yes",
                 "alerts          1", "tensorboard --logdir runs/tb", "runs/summary.json", "runs/shoal.log"):
        assert part in text
    assert len(lines) <= 10
    failed = result_lines({**summary, "worker_exit_codes": {"worker0": 1}, "exactly_once": False}, False)
    assert failed[0].startswith("training FAILED") and "worker0=1" in "\n".join(failed)
    assert "exactly once    NO" in "\n".join(failed)
