"""``shoal status --watch``: frames in place on a terminal, one after another elsewhere, an outage is a line."""
from __future__ import annotations

import io

import grpc

from shoal.cli.main import main
from shoal.cli.watch import HOME_AND_CLEAR, watch


class Down(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE


class TTY(io.StringIO):
    def isatty(self):
        return True


def test_frames_redraw_in_place_on_a_terminal_and_an_outage_is_shown_not_fatal():
    answers = iter(["job: epoch 1", Down(), "job: epoch 2"])

    def read():
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    out, slept = TTY(), []
    assert watch(read, 0.5, out, sleep=slept.append, now=lambda: 0.0, times=3) == 0
    frames = out.getvalue().split(HOME_AND_CLEAR)[1:]
    assert len(frames) == 3 and slept == [0.5, 0.5]
    assert frames[0].startswith("job: epoch 1\n") and "Ctrl-C to stop" in frames[0]
    assert frames[1].startswith("cannot reach the chief: UNAVAILABLE; trying again every 0.5s")
    assert frames[2].startswith("job: epoch 2")


def test_off_a_terminal_frames_follow_each_other_and_ctrl_c_ends_cleanly():
    calls = []

    def read():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return f"frame {len(calls)}"

    out = io.StringIO()
    assert watch(read, 1, out, sleep=lambda s: None, now=lambda: 0.0) == 0
    assert HOME_AND_CLEAR not in out.getvalue() and out.getvalue().count("frame ") == 2


def test_a_bad_interval_is_a_one_line_error(capsys):
    assert main(["status", "--chief", "127.0.0.1:1", "--watch", "0"]) == 2
    assert capsys.readouterr().err == "shoal status: error: --watch takes seconds between refreshes (> 0), got 0.0\n"
