"""``shoal compare``'s pieces: flags, curves, the target, the table."""
from __future__ import annotations

import pytest

from shoal.cli.compare import add_targets, cases, parse_budget, smooth, table, time_to
from shoal.cli.main import main
from shoal.errors import InvalidArgument

DIGITS = "examples/digits.py"


@pytest.mark.parametrize("args, text", [
    (["--budget", "soon", DIGITS], "--budget must be a positive time like 60s, 5m or 1h, got 'soon'"),
    (["--codecs", "nope", DIGITS], "unknown compressor 'nope'; known: bf16"),
    (["--modes", "sync", "fast", DIGITS], "--modes takes one or more of sync, async, ssp; got sync fast"),
    (["--budget", "5s", "--epochs", "2", DIGITS], "give --budget or --epochs, not both"),
    (["--mode", "sync", DIGITS], "drop --mode sync"),
    (["--modes", "sync"], "which training script?"),
    (["--codecs", "none", "bf16", "nope.py"], "training script 'nope.py' does not exist"),
    (["--modes", "sync", "sync", DIGITS], "name a case twice"),
])
def test_bad_input_is_one_line_and_runs_nothing(tmp_path, capsys, monkeypatch, args, text):
    monkeypatch.chdir(__import__("pathlib").Path(__file__).resolve().parents[2])
    assert main(["compare", "--out", str(tmp_path / "c"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shoal compare: error: ") and text in err and err.count("\n") == 1, err
    assert not (tmp_path / "c").exists()


def test_budget_and_cases():
    assert parse_budget("90") == 90 and parse_budget("60s") == 60 and parse_budget("1.5m") == 90
    assert parse_budget(None) == 0
    with pytest.raises(InvalidArgument):
        parse_budget("0s")
    assert [c.name for c in cases(["sync", "async"], ["none", "bf16"])] == ["sync", "sync+bf16", "async",
                                                                           "async+bf16"]


def test_smooth_and_time_to_target():
    assert smooth([4, 2, 0, 2], window=2) == [4, 3, 1, 1]
    assert time_to([(0.0, 3.0), (1.0, 2.0), (2.5, 0.9), (3.0, 1.1)], 1.0) == 2.5
    assert time_to([(0.0, 3.0)], 1.0) is None


def row(case, final, seconds, once=True):
    return {"case": case, "seconds": 10.0, "train_seconds": 8.0, "steps_per_s": 12.5, "updates_per_s": 6.25,
            "samples_per_s": 400.0, "final_loss": final, "metric": 0.95, "exactly_once": once, "at_most_once": True,
            "curve": {"seconds": seconds, "loss": [2.0, 1.0, final], "samples": [0, 10, 20]}}


def test_the_default_target_is_the_worst_final_loss_and_the_table_shows_every_column():
    rows = [row("sync", 0.5, [0.0, 4.0, 8.0]), row("async", 0.3, [0.0, 2.0, 3.0], once=False)]
    target = add_targets(rows, None)
    assert target == 0.5 and rows[0]["time_to_target"] == 8.0 and rows[1]["time_to_target"] == 3.0
    text = table(rows, "test_accuracy", target).splitlines()
    assert text[0].split() == ["case", "seconds", "train", "s", "steps/s", "updates/s", "samples/s", "final", "loss",
                               "test_accuracy", "to", "loss", "0.5", "exactly", "once"]
    assert text[1].split() == ["sync", "10.0", "8.0", "12.5", "6.2", "400", "0.5000", "0.9500", "8.0s", "yes"]
    assert text[2].endswith("at most (partial)")
    assert add_targets(rows, 0.1) == 0.1 and rows[0]["time_to_target"] is None
