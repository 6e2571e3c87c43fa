"""A worker asked to leave: SIGTERM (``shoal worker``'s handler calls :func:`request_stop`) or the chief
(an evicted straggler). Every Trainer of the process hands back its data task at the next batch boundary,
leaves the job and ends the process with exit code 0 (``shoal.worker.trainer`` re-exports these)."""
from __future__ import annotations

import logging
import threading
import weakref
log = logging.getLogger("shoal.worker.trainer")      # one logger for the worker's lines, as before

_STOP_REQUESTED = threading.Event()
_LIVE: weakref.WeakSet = weakref.WeakSet()     # every Trainer of this process (they add themselves)


def request_stop() -> bool:
    """Preemption (``shoal worker`` calls this on SIGTERM): every Trainer of this process hands back its
    data task at the next batch boundary, leaves the job and ends the process with exit code 0.
    Safe to call from a signal handler: it only sets flags. False when no Trainer is taking batches
    (nothing would see the request: the caller should end the process itself)."""
    _STOP_REQUESTED.set()
    taking = False
    for trainer in list(_LIVE):
        feed = trainer._feed
        if feed is not None:
            feed.interrupt()
            taking = True
        elif trainer._batch_source is not None or trainer.accumulation is not None:
            taking = True           # a DistributedOptimizer's: its next step() or iteration hands back
    return taking


def _leave_asked(why: str) -> None:
    """The chief asks this worker to leave: it hands back its task and exits 0, as on SIGTERM."""
    log.warning("the chief asks this worker to leave (%s): handing back its task at the next batch", why)
    request_stop()


def stop_requested() -> bool:
    """Whether SIGTERM asked this process to leave (:func:`request_stop`): checked at batch boundaries."""
    return _STOP_REQUESTED.is_set()
