"""The time-to-accuracy bench's pure parts (bench/_tta.py): cases, time to target, DDP's data order,
the summary over rounds."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import _tta  # noqa: E402
from _tta import Case, Point  # noqa: E402


@pytest.mark.parametrize("spec, case", [
    ("none", Case("none")),
    ("topk", Case("topk")),
    ("bf16/bf16", Case("bf16", "bf16")),
    ("none@32:2", Case("none", "none", 32, 2)),
    ("bf16/bf16@32:2", Case("bf16", "bf16", 32, 2)),
    ("topk:0.05@4:0", Case("topk:0.05", "none", 4, 0)),
    ("topk+server-momentum", Case("topk", server_momentum=True)),
    ("topk@4:2+server-momentum", Case("topk", "none", 4, 2, True)),
])
def test_a_case_is_codec_pull_and_pipeline_as_in_mlp(spec, case):
    assert _tta.parse_case(spec) == case


@pytest.mark.parametrize("spec", ["", "/bf16", "none/", "a/b/c", "none@32", "none@32:", "none@x:2", "none@0:2",
                                  "none@4:-1", "@4:2", "+server-momentum", "topk@4+server-momentum"])
def test_a_malformed_case_is_refused(spec):
    with pytest.raises(ValueError):
        _tta.parse_case(spec)


def test_case_names_follow_mlp_and_leave_out_the_defaults():
    assert Case("none").name("async", ps=2) == "shoal-async-none"
    assert Case("none", "none", 2, 0).name("async", ps=2) == "shoal-async-none"
    assert Case("bf16", "bf16", 32, 2).name("sync", ps=2) == "shoal-sync-bf16-pull-bf16-shards32-window2"
    assert Case("topk", server_momentum=True).name("async", ps=2) == "shoal-async-topk-server-momentum"


def curve(*accuracies: float) -> list[Point]:
    return [Point(seconds=10.0 * (i + 1), accuracy=a, steps=5 * (i + 1), steps_all=10 * (i + 1))
            for i, a in enumerate(accuracies)]


def test_time_to_target_is_the_first_evaluation_at_or_above_it_not_the_best():
    c = curve(0.5, 0.94, 0.95, 0.93, 0.99)
    assert _tta.time_to_target(c, 0.95) == c[2]
    assert _tta.time_to_target(c, 0.94) == c[1]
    assert _tta.time_to_target(c, 0.995) is None
    assert _tta.time_to_target([], 0.5) is None


def test_outcome_reports_the_hit_and_the_curve():
    out = _tta.outcome(curve(0.3, 0.96, 0.97), 0.95)
    assert (out["reached"], out["seconds"], out["steps"], out["steps_all"]) == (True, 20.0, 10, 20)
    assert out["best_accuracy"] == 0.97 and out["evals"] == 3
    assert out["curve"][1] == [20.0, 0.96, 20]
    missed = _tta.outcome(curve(0.3, 0.4), 0.95)
    assert (missed["reached"], missed["seconds"], missed["steps"]) == (False, None, None)


def test_ratio_is_ddp_over_the_case_and_only_when_both_reached():
    assert _tta.ratio(30.0, 20.0) == 1.5
    assert _tta.ratio(30.0, 60.0) == 0.5
    assert _tta.ratio(None, 20.0) is None
    assert _tta.ratio(30.0, None) is None


def test_ddp_ranks_take_disjoint_equal_shares_of_the_full_batches_in_a_new_order_each_epoch():
    size, batch, world = 1347, 32, 2                 # 42 full batches, a partial one left out
    shares = [_tta.rank_batches(size, batch, world, r, epoch=0) for r in range(world)]
    assert len(shares[0]) == len(shares[1]) == 21
    assert set(shares[0]).isdisjoint(shares[1]) and set(shares[0]) | set(shares[1]) == set(range(42))
    assert _tta.rank_batches(size, batch, world, 0, epoch=1) != shares[0]
    assert _tta.rank_batches(size, batch, world, 0, epoch=0) == shares[0]      # every rank computes the same order
    odd = [_tta.rank_batches(100, 10, 3, r, epoch=0) for r in range(3)]      # 10 batches: 9 dealt, 3 each
    assert [len(s) for s in odd] == [3, 3, 3]


def test_the_clock_leaves_out_the_time_it_was_stopped():
    t = [100.0]
    clock = _tta.Clock(lambda: t[0])
    t[0] = 103.0
    with clock.stopped():
        t[0] = 110.0
    t[0] = 112.0
    assert clock.seconds() == pytest.approx(5.0)
    with pytest.raises(RuntimeError), clock.stopped():
        t[0] = 120.0
        raise RuntimeError
    assert clock.seconds() == pytest.approx(5.0)


def test_summary_takes_medians_over_the_rounds_that_reached_the_target():
    rounds = [
        {"seconds": 20.0, "steps": 50, "steps_all": 100, "ratio_vs_ddp": 1.5, "cores": {"worker0": 0.9, "ps0": 0.2}},
        {"seconds": None, "steps": None, "steps_all": None, "ratio_vs_ddp": None, "cores": {"worker0": 0.7, "ps0": None}},
        {"seconds": 40.0, "steps": 70, "steps_all": 140, "ratio_vs_ddp": 0.5, "cores": {"worker0": 0.8, "ps0": 0.4}},
        {"seconds": 30.0, "steps": 60, "steps_all": 120, "ratio_vs_ddp": 0.9, "cores": {"worker0": 1.0, "ps0": 0.3}},
    ]
    s = _tta.summarize("shoal-async-none", rounds)
    assert (s["rounds"], s["reached"]) == (4, 3)
    assert s["median_ratio_vs_ddp"] == 0.9 and s["ratio_per_round"] == [1.5, None, 0.5, 0.9]
    assert s["median_seconds"] == 30.0 and s["seconds_per_round"] == [20.0, None, 40.0, 30.0]
    assert (s["median_steps"], s["median_steps_all"]) == (60, 120)
    assert s["cores_used"] == {"worker0": 0.85, "ps0": 0.3}
    ddp = _tta.summarize(_tta.DDP, rounds)
    assert "median_ratio_vs_ddp" not in ddp and ddp["median_seconds"] == 30.0


def test_a_case_that_never_reached_the_target_has_no_median():
    s = _tta.summarize("shoal-async-topk", [{"seconds": None, "ratio_vs_ddp": None}])
    assert s["reached"] == 0 and s["median_seconds"] is None and s["median_ratio_vs_ddp"] is None


@pytest.mark.parametrize("argv, says", [
    (["--cases", "bogus"], "unknown compressor 'bogus'"),
    (["--cases", "bf16/int8"], "unknown pull codec 'int8'"),
    (["--cases", "topk+server"], "unknown compressor 'topk+server'"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--target", "1.5"], "--target is a test accuracy"),
])
def test_the_bench_refuses_a_typo_before_it_starts_anything(argv, says, capsys):
    import tta

    with pytest.raises(SystemExit):
        tta.parse_args(argv)
    assert says in capsys.readouterr().err


def test_the_bench_takes_the_codec_specs_the_worker_takes():
    import tta

    args = tta.parse_args(["--cases", "topk:0.05", "sign+lz4@4:2", "bf16/fp16", "sign+lz4+server-momentum"])
    assert [c.codec for c in args.cases] == ["topk:0.05", "sign+lz4", "bf16", "sign+lz4"]
    assert [c.server_momentum for c in args.cases] == [False, False, False, True]
