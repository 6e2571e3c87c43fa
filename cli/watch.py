"""``shoal status --watch``: the status screen, redrawn in place every few seconds until Ctrl-C."""
from __future__ import annotations

import sys
import time
from typing import IO, Callable

import grpc

HOME_AND_CLEAR = "\x1b[H\x1b[2J"


def watch(read: Callable[[], str], interval_s: float = 2.0, out: IO[str] = sys.stdout,
          sleep: Callable[[float], None] = time.sleep, now: Callable[[], float] = time.time,
          times: int | None = None) -> int:
    """Draws ``read()`` every ``interval_s``: in place on a terminal, one frame after another elsewhere.

    A chief that does not answer is a line on the screen, not the end of the watch
    (it may be restarting from its journal). Returns 0 on Ctrl-C; ``times`` bounds the frames (tests).
    """
    tty = _is_tty(out)
    frame = 0
    try:
        while times is None or frame < times:
            try:
                body = read()
            except grpc.RpcError as exc:
                body = f"cannot reach the chief: {exc.code().name}; trying again every {interval_s:g}s"
            stamp = time.strftime("%H:%M:%S", time.localtime(now()))
            text = f"{body}\n\n(every {interval_s:g}s, {stamp}; Ctrl-C to stop)\n"
            out.write(HOME_AND_CLEAR + text if tty else ("\n" if frame else "") + text)
            out.flush()
            frame += 1
            if times is None or frame < times:
                sleep(interval_s)
    except KeyboardInterrupt:
        out.write("\n")
    return 0


def _is_tty(out: IO[str]) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):
        return False
