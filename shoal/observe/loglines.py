"""Per-shard log lines that come in bursts, folded into one.

A job with many shards says the same routine thing once per shard when it starts and when it ends
(32 shards placed, given backups, let go of): on a terminal that is a log dump. Up to ``limit`` lines
are logged as they are; a longer burst is logged as its first two and a count, at the burst's level,
and every line of it at DEBUG (``--log-level debug`` or ``SHOAL_LOG_LEVEL=debug`` lists them).
"""
from __future__ import annotations

import logging
from typing import Sequence

BURST = 4


def log_burst(logger: logging.Logger, lines: Sequence[str], level: int = logging.INFO, limit: int = BURST) -> None:
    lines = list(lines)
    if len(lines) <= limit:
        for line in lines:
            logger.log(level, "%s", line)
        return
    logger.log(level, "%s; %s; and %d more like them (debug logging lists every one)", lines[0], lines[1],
               len(lines) - 2)
    for line in lines:
        logger.debug("%s", line)
