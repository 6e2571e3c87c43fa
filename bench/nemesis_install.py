"""The nemesis's ``install_kill`` (``bench/nemesis.py --install-kills``, issue 20): one ps SIGKILLed, and once
its supervisor has restarted it, the other ps (then the primary of every shard) SIGKILLed ``before`` the
restart's first copy starts, ``during`` it, or just ``after`` every copy is whole (bench/_install_kill.py).

Killed before its backup holds a whole copy, a primary takes the only copy holding every acknowledged update
with it: under ``--recovery consistent`` (the nemesis's) the job rolls back to its newest checkpoint (counted
in the summary's ``rollbacks``) or stops saying why; it never goes on with the incomplete copy. Killed after,
its backup is promoted and nothing is lost. The invariants are the nemesis's own.
"""
from __future__ import annotations

import random

from _install_kill import POINTS, NotReached, kill_around_install

# A restarted ps takes 5-30 s to start and join on a shared 2-core host, and the kill comes up to 6 s into
# training: a schedule with an install_kill trains at least this many epochs (digits: 11 tasks an epoch, 4-10 s
# at the nemesis's --step-delay on that host, sync or async), so that training outlasts the restart and its
# copy. (20 async epochs, at first, took a schedule with two rollbacks past the 300 s bound at load 30.)
MIN_EPOCHS = {"sync": 10, "async": 10}


def draw(rng: random.Random, schedule) -> dict:
    """The Fault fields of an install_kill (which ps dies first, and when the primary dies); lengthens
    ``schedule`` so that the copy comes before the end of training."""
    schedule.epochs = max(schedule.epochs, MIN_EPOCHS[schedule.mode])
    return {"target": rng.choice(("ps0", "ps1")), "point": rng.choice(POINTS)}


def apply(run, fault) -> None:
    """Runs ``fault`` on the nemesis's ``run`` (its pids, log and process); notes what it did or why not."""
    try:
        kill_around_install(fault.point, run.pids, run.work / "local.log",
                            lambda: run.proc.poll() is None,
                            first=fault.target, timeout_s=run.bound_s, note=run.note)
    except NotReached as exc:
        run.note(f"install_kill: not reached ({exc})")
        return
    run.note(f"install_kill: done after {run.steps()} worker steps")   # mid-training, or after the workers ended
