"""The update guard's side of a shard: its refusals counted, logged once, and expulsions (lock held).

Half of :class:`shoal.ps.shard.Shard`, as :class:`~shoal.ps.shard_copies.ShardCopies` is: the checks
themselves are :class:`shoal.ps.guard.UpdateGuard`'s, called by :meth:`Shard.push` and ``Shard._apply``.
"""
from __future__ import annotations

import logging

from shoal.settings.config import JobConfig
from shoal.errors import PermissionDenied
from shoal.ps.guard import UpdateGuard
from shoal.ps.update import PushResult, Update

log = logging.getLogger("shoal.ps.shard")


class ShardGuard:
    def set_guard(self, job: JobConfig) -> None:
        """Takes the job's update guard settings (the host calls it as it places the copy)."""
        with self._cond:
            self.guard = UpdateGuard(self.guard.bounds.configured, lr_factor=job.lr_factor,
                                     norm_factor=job.grad_norm_factor, norm_policy=job.grad_norm_policy,
                                     norm_warmup=job.grad_norm_warmup, expel_after=job.expel_after)

    def _count_guarded(self, worker: str, reason: str) -> None:
        """Counts a guard refusal of ``worker``'s (lock held); logs the first, expels after a streak."""
        if self.guard.refusals.refused(worker, reason):
            log.warning("shard %d: an update of %s refused: %s (logged once per worker, counted in shoal "
                        "status)", self.shard_id, worker, reason)
        self._check_not_expelled(worker)

    def _refuse_guarded(self, worker: str, reason: str) -> PushResult:
        """A push the guard refused (lock held): not applied; its batch goes back to be trained again."""
        self.stats.pushes_dropped += 1
        self._count_guarded(worker, reason)
        return PushResult(False, self.version, f"shard {self.shard_id} refused the update of {worker}: {reason}")

    def _check_not_expelled(self, worker: str) -> None:
        why = self.guard.refusals.expelled.get(worker)
        if why:
            raise PermissionDenied(f"worker {worker} is expelled from shard {self.shard_id}: {why} "
                                   f"(--expel-after {self.guard.refusals.expel_after})")

    def guard_counts(self) -> dict[str, int]:
        """Guard refusals per worker (clipped pushes and rolled-back updates included)."""
        with self._cond:
            return dict(self.guard.refusals.counts)

    def _rolled_back(self, u: Update) -> None:
        """Counts a rolled-back step against the workers whose pushes made it (lock held)."""
        self.guard.refusals.rolled_back += 1
        reason = f"the step to version {u.version} would have left a weight or optimizer state NaN/Inf; rolled back"
        for w in u.workers:
            if self.guard.refusals.refused(w, reason):
                log.warning("shard %d: %s (pushes of %s; logged once per worker)", self.shard_id, reason, w)

