"""One parameter shard: a flat fp32 slice, its optimizer, version and open round.

Thread-safe pure state (no sockets): the servicer decodes frames and calls
:meth:`Shard.push` / :meth:`Shard.snapshot`; tests drive it directly. For a
checkpoint, :meth:`Shard.freeze` holds updates at a version, :meth:`Shard.export_state`
copies everything a restore needs (:meth:`Shard.from_state`, both in ps/shard_copies.py) and
:meth:`Shard.thaw` lets updates go on.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np
import torch

from shoal.ps.round_timing import RoundTimer
from shoal.ps.changes import ChangeLog
from shoal.ps.guard import UpdateGuard, grad_norm, scaled
from shoal.ps.shard_copies import ShardCopies
from shoal.ps.shard_guard import ShardGuard
from shoal.ps.shard_tables import Rows, ShardTables
from shoal.ps.sparse import RoundSum, SparseGrad
from shoal.ps.update import PushResult, Update, count_nonfinite
from shoal.ps.consistency import Action, Admission, PushContext, Rule
from shoal.ps.ledger import BatchKey, Ledger
from shoal.state.optim import build_optimizer, magnitude
from shoal.settings.config import OptimizerSpec
from shoal.net.wire import encode_weights, pull_itemsize
from shoal.errors import (HANDED_OVER, NOT_PRIMARY, DeadlineExceeded, FailedPrecondition, InvalidArgument,
                          ResourceExhausted)

log = logging.getLogger(__name__)

KEY_MEMORY = 1 << 16  # idempotency keys remembered per shard
# --nonfinite refuse: after this many pushes in a row holding NaN/Inf, a worker's next one fails
NONFINITE_STREAK = 3


@dataclass
class ShardStats:
    pushes_applied: int = 0
    pushes_dropped: int = 0
    updates: int = 0
    sparse_updates: int = 0      # of which applied to the named elements only (ps/sparse.py)
    nonfinite: dict[str, int] = field(default_factory=dict)   # pushes holding NaN/Inf not applied, per worker


class Shard(ShardCopies, ShardGuard):
    """One shard's state and rules; its copies (checkpoint, backup, digest) are :class:`ShardCopies`,
    its update guard's refusals :class:`ShardGuard`."""

    def __init__(self, shard_id: int, values: torch.Tensor, optimizer: OptimizerSpec, rule: Rule,
                 fingerprint: str, clock: Callable[[], float] = time.monotonic, flat_start: int = 0):
        if values.dim() != 1 or values.dtype != torch.float32:
            raise InvalidArgument("shard values must be a 1-D float32 tensor")
        self.shard_id = shard_id
        self.fingerprint = fingerprint
        self.optimizer_spec = optimizer
        self.rule = rule
        self._clock = clock
        self._param = torch.nn.Parameter(values.detach().clone(), requires_grad=False)
        self.flat_start = flat_start           # where the slice starts in the flat model (param groups)
        self._opt = build_optimizer(self._param, optimizer, flat_start)
        self.applied_hparams: dict[str, float] = self._opt.hparams()   # what the last update stepped with
        # what a push may carry and how large its gradient may be (ps/guard.py; the host sets it from the job)
        self.guard = UpdateGuard(self.applied_hparams)
        self._cond = threading.Condition()
        self.version = 0
        self.changes = ChangeLog(self.numel, self.version, optimizer)
        self._round_sum: RoundSum | None = None
        self._round_sparse = True
        self._round_exact = ""          # the open round is one push whose values this dtype holds exactly
        self._round_workers: set[str] = set()
        # Workers present in the open round with nothing new for it: their push, computed on this
        # version, named batches this shard applied in an earlier round. A sync round does not wait for them
        # (it would wait for ever if that worker's only work is such a batch, handed back by another
        # shard whose round in turn waits on this one), and does not count them in its average.
        self._round_present: set[str] = set()
        self._round_keys: list[str] = []
        self._round_batches: dict[BatchKey, str] = {}
        self._round_hparams: dict[str, float] = {}
        self._clocks: dict[str, int] = {}            # ssp: updates applied per worker
        # Workers a sync round waits for (when busy): those present before the first update, and
        # those that have offered a gradient since. A worker that joins a running job is still loading
        # data and taking its first (slow) step; the others train on meanwhile, and its first
        # gradient (dropped as stale if the round closed without it) makes it part of the rounds.
        self._pushed: set[str] = set()
        self.ledger = Ledger()
        self._live: frozenset[str] = frozenset()
        self._keys: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._snapshots: dict[str, tuple[int, bytes]] = {}
        self._freeze: tuple[int, float, float] | None = None   # (held at version, thaw-by time, frozen since)
        self.stats = ShardStats()
        # Called with each Update before it is applied, lock held (ps/replication.py: forwards it to
        # the backup). If it raises, the update is not applied and the shard stops taking pushes.
        self.replicator: Callable[[Update], None] | None = None
        self.fenced = ""          # why this copy may no longer take pushes (another ps is primary)
        self.nonfinite = "refuse"  # the job's --nonfinite policy (the host sets it from the job)
        self._nonfinite_streak: dict[str, int] = {}
        self.rounds = RoundTimer(clock)   # sync: which worker each round waited for (ps/round_timing.py)
        self.tables = ShardTables(shard_id)    # embedding tables' partitions held here (ps/shard_tables.py)

    def declare_tables(self, specs: list[dict], num_shards: int) -> list[str]:
        """Holds partition ``shard_id`` of each table in ``specs`` (those held already must match)."""
        with self._cond:
            return self.tables.declare(specs, num_shards)

    def lookup_rows(self, table: str, ids: np.ndarray) -> tuple[int, np.ndarray]:
        """``(version, rows)`` of unique ``ids`` of ``table`` (rows never updated: their initial value)."""
        with self._cond:
            self._check_not_fenced()
            return self.version, self.tables.lookup(table, ids)

    def table_status(self) -> list[dict]:
        """Rows, bytes and bytes per row of each table's partition here (shoal status, metrics)."""
        with self._cond:
            return self.tables.status()

    @property
    def numel(self) -> int:
        return self._param.numel()

    @property
    def round_pending(self) -> int:
        return len(self._round_workers)

    # ------------------------------------------------------------ updates

    def push(self, worker: str, version: int, grad: torch.Tensor | SparseGrad, key: str = "",
             batch: BatchKey | None = None, wait_s: float = 30.0, owned: bool = False,
             sparse: bool = False, hparams: dict[str, float] | None = None,
             batches: tuple[BatchKey, ...] = (), exact: str = "", rows: Rows = ()) -> PushResult:
        """Offers one worker's gradient for this shard; applies it when the rule says so.

        ``key`` names the push (a retry carries the same key and is applied once);
        ``batch`` names the data it came from (applied at most once per epoch,
        whoever pushes it); ``batches`` names several, for a gradient accumulated over micro-batches:
        if any of them was applied before, the whole push is refused (its ``applied`` says which). ``owned``: the shard may keep and modify ``grad``. An ``ssp`` push that is too far ahead waits up to
        ``wait_s`` and then fails with a retryable ResourceExhausted. ``sparse``: the gradient is zero
        outside a few elements (top-k), which lets delta pulls send only what the update changed; a
        :class:`~shoal.ps.sparse.SparseGrad` is (and is applied to its elements only where exact).
        ``hparams``: the user's current hyper-parameters (``"0.lr"``, ...; an LR scheduler's); the
        update that applies this push steps with the newest a push of its round carried. ``exact``: a
        narrower dtype that holds every value of ``grad`` exactly (``"bfloat16"``: a bf16 push); an
        update of this push alone travels to the backup in it (ps/update_wire.py). ``rows``: the row
        gradients of the embedding tables' ids this shard holds ``(table, ids, fp32 (n, dim))``, applied
        with the dense gradient in the same update (summed per id over a sync round and averaged).
        """
        named = (batch, *batches) if batch is not None else tuple(batches)
        sparse = sparse or isinstance(grad, SparseGrad)
        shape = (grad.numel,) if isinstance(grad, SparseGrad) else tuple(grad.shape)
        if shape != (self.numel,):
            raise InvalidArgument(f"shard {self.shard_id} has {self.numel} elements, gradient has {shape}")
        bad = count_nonfinite(grad.values if isinstance(grad, SparseGrad) else grad)
        if rows:
            with self._cond:
                rows = self.tables.check_push(rows)
            bad += self.tables.count_nonfinite(rows)
        if bad:
            return self._refuse_nonfinite(worker, bad, named)
        if hparams:
            self._opt.check_hparams(hparams)
        norm = grad_norm(grad)
        deadline = self._clock() + wait_s
        with self._cond:
            self._check_not_expelled(worker)
            self._pushed.add(worker)
            while True:
                self._check_not_fenced()
                if key and (key in self._keys or key in self._round_keys):
                    return PushResult(True, self.version, "duplicate key", duplicate=True)
                owners = {b: self.ledger.owner(b) or self._round_batches.get(b) for b in named}
                applied = tuple(b for b, owner in owners.items() if owner is not None)
                if applied:
                    self.stats.pushes_dropped += 1
                    if version == self.version and all(self.ledger.owner(b) for b in applied):
                        self._round_present.add(worker)      # applied in an earlier round: nothing new
                        self._maybe_close_round()
                    b = applied[0]
                    return PushResult(False, self.version, f"batch {b.epoch}/{b.start} was applied by push "
                                      f"{owners[b]}", duplicate=True, applied=applied)
                if worker not in self._clocks:      # pushing before the view that names it reached this shard
                    self._clocks[worker] = self._clock_floor()
                verdict = Admission(Action.WAIT, f"shard {self.shard_id} is frozen at version {self.version} for "
                                    f"a checkpoint") if self._holding() else \
                    self.rule.admit(PushContext(worker, version, self.version, self._round_workers,
                                                self._live, self._clocks))
                if verdict.action is not Action.WAIT:
                    break
                left = deadline - self._clock()
                if left <= 0:
                    raise ResourceExhausted(verdict.reason)
                self._cond.wait(min(left, 1.0))
            if verdict.action is Action.DROP:
                self.stats.pushes_dropped += 1
                log.debug("shard %d drops push of %s: %s", self.shard_id, worker, verdict.reason)
                return PushResult(False, self.version, verdict.reason)
            judged = self.guard.judge(hparams, norm)
            if judged.refuse:
                return self._refuse_guarded(worker, judged.refuse)
            if judged.scale != 1.0:
                grad, owned = scaled(grad, judged.scale, owned), True
                self._count_guarded(worker, self.guard.clip_reason(judged))
            else:
                self.guard.refusals.taken(worker)
            self.guard.norms.accept(judged.norm * judged.scale)
            if self._round_sum is None:
                # A gradient applied alone (async, ssp) is only read by the optimizer: no copy.
                alone = self.rule.round_complete({worker}, self._expected())
                self._round_sum = RoundSum(grad, owned or alone)
                self._round_sparse, self._round_exact = sparse, exact
            else:
                self._round_sparse, self._round_exact = self._round_sparse and sparse, ""
                self._round_sum.add(grad)
            self._round_workers.add(worker)
            self.rounds.arrived(worker)
            self.tables.join_round(rows)
            self._nonfinite_streak.pop(worker, None)
            if hparams:
                self._round_hparams.update(hparams)
            if key:
                self._round_keys.append(key)
            for b in named:
                self._round_batches[b] = key or worker
            self.stats.pushes_applied += 1
            self._maybe_close_round()
            return PushResult(True, self.version)

    def _refuse_nonfinite(self, worker: str, bad: int, named: tuple[BatchKey, ...] = ()) -> PushResult:
        """A gradient holding NaN/Inf is never applied; the policy says what its worker hears.

        ``refuse``: not applied, and after :data:`NONFINITE_STREAK` in a row the worker's push fails
        with InvalidArgument saying why; ``skip``: not applied, counted, the worker trains on;
        ``stop``: the first one fails the worker's push. Logged once per worker. The batch is not
        handed back to be trained again (``duplicate``): it would most likely fail the same way. Under
        ``skip`` the ledger records the push's batches as skipped, so the job's data is accounted for.
        """
        with self._cond:
            total = self.stats.nonfinite[worker] = self.stats.nonfinite.get(worker, 0) + 1
            streak = self._nonfinite_streak[worker] = self._nonfinite_streak.get(worker, 0) + 1
            version = self.version
            if self.nonfinite == "skip":
                for b in named:
                    if self.ledger.owner(b) is None and b not in self._round_batches:
                        self.ledger.record(b, f"skipped ({worker}: non-finite)")
        reason = (f"the gradient of {worker} for shard {self.shard_id} holds {bad} non-finite value(s) "
                  f"(NaN/Inf); not applied")
        if total == 1:
            log.warning("shard %d: %s (--nonfinite %s; logged once per worker, counted in shoal status)",
                        self.shard_id, reason, self.nonfinite)
        if self.nonfinite == "stop" or (self.nonfinite == "refuse" and streak > NONFINITE_STREAK):
            raise InvalidArgument(f"{reason}: {streak} such push(es) in a row and the job runs with "
                                  f"--nonfinite {self.nonfinite}; check the loss and the learning rate")
        return PushResult(False, version, reason, duplicate=True)

    def nonfinite_counts(self) -> dict[str, int]:
        with self._cond:
            return dict(self.stats.nonfinite)

    def set_live_workers(self, workers: Iterable[str]) -> None:
        """Membership changed: the open round may now be complete, a waiting push may go."""
        with self._cond:
            self._live = frozenset(workers)
            if self.version == 0:
                self._pushed |= self._live
            floor = self._clock_floor()
            for w in self._live:
                self._clocks.setdefault(w, floor)   # a newcomer starts level with the slowest
            self._close_round_quietly()
            self._cond.notify_all()

    def _clock_floor(self) -> int:
        """ssp: where a newcomer's clock starts (lock held): level with the slowest live worker. One that
        started at 0 on a shard whose clock the others had moved far on held them all back there, and
        itself waited on a shard that had it level: a deadlock (tests/system/test_elastic.py, ssp)."""
        return min((self._clocks[w] for w in self._live if w in self._clocks), default=0)

    def _expected(self) -> frozenset[str]:
        """The workers an open round waits for (lock held): busy ones that have pushed here before."""
        return self._live & self._pushed

    def _maybe_close_round(self) -> None:
        if not self._round_workers or self.fenced or self._holding() or \
                not self.rule.round_complete(self._round_workers | self._round_present, self._expected()):
            return
        n = len(self._round_workers)
        assert self._round_sum is not None
        grad = self._round_sum.average(n)
        update = Update(self.version + 1, grad, tuple(self._round_keys), tuple(self._round_batches.items()),
                        tuple(sorted(self._round_workers)), self._round_sparse, tuple(sorted(self._round_hparams.items())),
                        self._round_exact, self.tables.close_round(n))
        r = self.replicator
        start = getattr(r, "start", None)
        if r is None:
            self._apply(update)
        elif start is None:                 # a plain callable: the backup first, then this copy
            self._replicate(update, lambda: r(update))
            self._apply(update)
        else:
            # on its way to the backup while this copy applies it; the lock is held until the backup has
            # it, so nobody sees the version before then, and a copy whose update the backup did not take
            # is fenced (never serves again), whatever it applied meanwhile
            sending = self._replicate(update, lambda: start(update))
            try:
                self._apply(update)
            finally:
                self._replicate(update, lambda: r.finish(update, sending))
        self._round_sum, self._round_workers, self._round_keys, self._round_present = None, set(), [], set()
        self._round_batches, self._round_hparams = {}, {}
        self.rounds.closed()
        log.debug("shard %d applied %d gradient(s) -> version %d", self.shard_id, n, self.version)

    def _replicate(self, update: Update, call: Callable[[], Any]) -> Any:
        """Runs ``call`` (a step of handing ``update`` to the backup, lock held); if it raises, this copy is
        fenced and the error goes on to the pushing worker."""
        try:
            out = call()
        except Exception as exc:
            # the backup this copy kept in step was made primary (a planned move), or the view dropped the
            # copy as a planned move while the update was on its way (the fence names it first): routine,
            # and the workers are told so, so they follow the view quietly and send the update there
            handed = HANDED_OVER in str(exc) or HANDED_OVER in (self.fenced or "")
            log.log(logging.INFO if handed else logging.ERROR,
                    "shard %d: cannot replicate version %d (%s); this copy takes no more pushes",
                    self.shard_id, update.version, str(exc) or type(exc).__name__)
            self._fence_locked(str(exc) or type(exc).__name__)
            if handed and HANDED_OVER not in str(exc):
                self._check_not_fenced()
            raise
        # The view may have dropped this copy while the update was on its way (fenced is set
        # without the lock, so that a replicator holding it cannot delay the view): not taken.
        self._check_not_fenced()
        return out

    def fence(self, why: str) -> None:
        """Another ps is this shard's primary now: this copy never applies or serves again.

        The open round is discarded (its workers re-send to the new primary, whose keys and ledger
        keep every push applied once); pushes waiting here fail, and pulls waiting for a version
        wake at once and fail, both with a :data:`NOT_PRIMARY` refusal that sends the worker to the
        view. The flag is set before the lock is taken, so a round on its way to the backup sees it.
        """
        self.fenced = self.fenced or why
        with self._cond:
            self._fence_locked(why)

    def _fence_locked(self, why: str) -> None:
        self.fenced = self.fenced or why
        self._round_sum, self._round_workers, self._round_keys, self._round_batches = None, set(), [], {}
        self._round_present = set()
        self.rounds.reset()
        self.tables.clear_round()
        self._cond.notify_all()

    def _check_not_fenced(self) -> None:
        if self.fenced:
            raise FailedPrecondition(f"shard {self.shard_id} here is {NOT_PRIMARY} any more: {self.fenced}")

    def _close_round_quietly(self) -> None:
        """Closes a round that became complete without a push (membership, thaw); a failure is logged."""
        try:
            self._maybe_close_round()
        except Exception:  # noqa: BLE001 - already logged and fenced; nobody to raise to
            pass

    def _apply(self, u: Update) -> None:
        """Takes one optimizer step (lock held): the same code on a primary and on its backup. A step that
        would leave a weight or the optimizer's state NaN/Inf is rolled back (the version, keys and ledger
        still advance, the same on the backup, which rolls the same step back). Table rows go first: a refused
        row update leaves the dense slice as it was too (a dense step rolled back keeps its rows, which were
        checked finite on their own: ps/tables)."""
        before = self.applied_hparams
        if self.tables:
            self.tables.apply(u.rows, u.version)
        if u.hparams:
            self._opt.set_hparams(dict(u.hparams))
            self.applied_hparams = self._opt.hparams()
        sparse = isinstance(u.grad, SparseGrad) and self._opt.sparse_exact()
        # saved first unless the step is proved finite (shoal/state/optim.py: needs_save); a sparse one: its elements
        saved = self._opt.save(u.grad.indices) if sparse else \
            self._opt.save() if self._opt.needs_save(magnitude(u.dense_grad())) else None
        touched = u.grad.indices if sparse and self._opt.step_sparse(u.grad.indices, u.grad.values) else None
        if touched is None:
            self._opt.step(u.dense_grad())
        else:
            self.stats.sparse_updates += 1
        self.version = u.version
        if self._opt.finite(touched):
            self.changes.record(u.version, u.grad if isinstance(u.grad, torch.Tensor) else None, u.sparse, touched)
        elif saved is None:         # cannot be: the bound proved it finite; said loudly, never silently kept
            raise AssertionError(f"shard {self.shard_id}: the step to version {u.version} left a non-finite value "
                                 f"that its bound ruled out (shoal/state/optim.py ShardOptimizer._growth)")
        else:
            self._opt.restore(saved)
            if u.hparams:
                self._opt.set_hparams(before)
                self.applied_hparams = before
            self.changes.record(u.version, None, True, torch.empty(0, dtype=torch.int64))   # nothing changed
            self._rolled_back(u)
        self.stats.updates += 1
        for k in u.keys:
            self._keys[k] = self.version
        while len(self._keys) > KEY_MEMORY:
            self._keys.popitem(last=False)
        for b, owner in u.batches:
            self.ledger.record(b, owner)
        for w in u.workers:     # a backup that has not heard of w yet starts it where its primary did
            self._clocks[w] = (self._clocks[w] if w in self._clocks else self._clock_floor()) + 1
        self._snapshots.clear()
        self._cond.notify_all()

    def apply_replica(self, u: Update, check: Callable[[], None] = lambda: None) -> int:
        """A backup takes its primary's update; a resent one is a no-op. Returns the version. ``check``
        (may raise: the sender is no longer the primary) runs under the shard's lock, so no promotion of
        this copy slips between it and the apply (ps/host.py)."""
        shape = (u.grad.numel,) if isinstance(u.grad, SparseGrad) else tuple(u.grad.shape)
        if shape != (self.numel,):
            raise InvalidArgument(f"shard {self.shard_id} has {self.numel} elements, update has {shape}")
        bad = count_nonfinite(u.grad.values if isinstance(u.grad, SparseGrad) else u.grad)
        if bad:
            raise InvalidArgument(f"shard {self.shard_id}: the update to version {u.version} holds {bad} "
                                  f"non-finite value(s) (NaN/Inf); not applied")
        with self._cond:
            self.tables.check_update(u.rows)
            check()
            if u.version <= self.version:
                return self.version
            if u.version != self.version + 1:
                raise FailedPrecondition(f"shard {self.shard_id} replica is at version {self.version}, "
                                         f"cannot apply update to {u.version}: needs a fresh copy")
            self._pushed.update(u.workers)      # a promoted backup waits for the same workers
            self._apply(u)
            return self.version

    def exclusive(self) -> threading.Condition:
        """The shard's lock, for a replicator that must see no update between two steps."""
        return self._cond

    # ------------------------------------------------------------ reads

    def wait_version(self, min_version: int, timeout_s: float) -> int:
        """Blocks until ``version >= min_version``; DeadlineExceeded after ``timeout_s``; a refusal as soon
        as the copy is fenced (:meth:`fence`), whatever version it holds."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self.version >= min_version or self.fenced, timeout=timeout_s)
            self._check_not_fenced()
            if not ok:
                raise DeadlineExceeded(f"shard {self.shard_id} still at version {self.version} "
                                       f"after {timeout_s:.1f}s (waiting for {min_version})")
            return self.version

    def snapshot(self, codec: str = "none",
                 build: Callable[[int, memoryview], bytes] | None = None) -> tuple[int, bytes]:
        """The current weights in ``codec`` (none|fp16|bf16), cached per version.

        ``build(version, raw_view)`` turns the encoded view into what is cached
        (e.g. one whole frame), so the weights are copied once per version; the
        view is only valid during the call.
        """
        with self._cond:
            self._check_not_fenced()
            key = (codec, build is not None)
            cached = self._snapshots.get(key)
            if cached is not None and cached[0] == self.version:
                return cached
            view = encode_weights(codec, self._param.detach())
            out = build(self.version, view) if build is not None else bytes(view)
            self._snapshots[key] = (self.version, out)
            return self.version, out

    def delta(self, codec: str, since: int) -> tuple[int, np.ndarray, bytes] | None:
        """``(version, indices, values in codec)`` of the elements changed after version ``since``; None
        when a full pull is the answer (the log does not cover ``since``, or the delta would not be
        much smaller than the weights)."""
        itemsize = pull_itemsize(codec)
        with self._cond:
            self._check_not_fenced()
            idx = self.changes.changed_since(since, self.version)
            if idx is None or len(idx) * (4 + itemsize) > self.numel * itemsize // 2:
                return None
            values = self._param.detach().index_select(0, torch.from_numpy(idx))
            return self.version, idx, bytes(encode_weights(codec, values))

    def worker_clocks(self) -> dict[str, int]:
        with self._cond:
            return dict(self._clocks)

    def ledger_summary(self):
        with self._cond:
            return self.ledger.summary()

    def values(self) -> torch.Tensor:
        """A copy of the current weights."""
        with self._cond:
            return self._param.detach().clone()

    # ------------------------------------------------------------ checkpoints

    def _holding(self) -> bool:
        """True while a freeze holds updates back at the current version (lock held); ends an expired hold."""
        if self._freeze is None:
            return False
        at, until, _ = self._freeze
        if self._clock() >= until:
            log.warning("shard %d: checkpoint freeze at version %d outlived its hold; thawing", self.shard_id, at)
            self._freeze = None
            self._cond.notify_all()
            return False
        return self.version >= at

    def freeze(self, target: int, timeout_s: float = 10.0, hold_s: float = 60.0) -> int:
        """Holds updates past ``max(target, version)``; returns once the shard is exactly there.

        Pushes that would advance it wait (as an ssp push does); a round still open
        stays open. DeadlineExceeded if the version is not reached within ``timeout_s``
        (the freeze stays: the caller thaws). The hold ends by itself after ``hold_s``.
        """
        with self._cond:
            at = max(target, self.version)
            since = self._freeze[2] if self._freeze is not None else self._clock()
            self._freeze = (at, self._clock() + hold_s, since)
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self.version >= at or self._freeze is None, timeout=timeout_s):
                raise DeadlineExceeded(f"shard {self.shard_id} still at version {self.version} after "
                                       f"{timeout_s:.1f}s (freezing at {at})")
            if self._freeze is None:
                raise FailedPrecondition(f"shard {self.shard_id} was thawed while freezing at version {at}")
            return self.version

    def thaw(self) -> float:
        """Ends a freeze; returns how long it held (0.0 if the shard was not frozen)."""
        with self._cond:
            if self._freeze is None:
                return 0.0
            held = self._clock() - self._freeze[2]
            self._freeze = None
            self._close_round_quietly()
            self._cond.notify_all()
            return held
