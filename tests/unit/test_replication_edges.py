"""Replication edges found by mutation testing: an update or a copy that arrives short or mixed with
another shard's is refused; updates over gRPC (one message, or chunked) reach the backup whole; a
replicator closed while an update is on its way never lets that update be acknowledged or seen.

Pure state, no sockets: a primary's shard and its :class:`Replicator` talk to a real backup
:class:`ShardHost` through a stand-in for the gRPC stubs (as in test_backup_recopy.py).
"""
import logging
import re
import threading

import grpc
import pytest
import torch

from harness import wait_until
from shoal.net import frames
from shoal.settings.config import JobConfig, OptimizerSpec
from shoal.errors import HANDED_OVER, FailedPrecondition, ShoalError, Unavailable
from shoal.proto import shoal_pb2 as pb
from shoal.ps.consistency import AsyncRule
from shoal.ps.ledger import BatchKey
from shoal.ps import replication
from shoal.ps.host import ShardHost
from shoal.ps.replication import FENCED, NEEDS_COPY, Replicator, install_frames, install_from_frames, replica_bytes
from shoal.ps.update_wire import update_frames, update_from_frames
from shoal.ps.shard import Shard
from shoal.ps.update import Update

from test_backup_recopy import Refusal

SGD = OptimizerSpec("sgd", {"lr": 1.0})


def an_update(n: int = 10, version: int = 1) -> Update:
    return Update(version, torch.arange(n, dtype=torch.float32), ("k1",), ((BatchKey(2, 64), "k1"),), ("w",),
                  hparams=(("0.lr", 0.5),))


# ---------------------------------------------------------------- frames

def test_an_update_missing_its_last_chunk_is_refused():
    fr = update_frames(0, "ps-0", an_update(10), chunk_bytes=16)          # 4 + 4 + 2 elements
    assert len(fr) == 3
    for one in (fr, update_frames(0, "ps-0", an_update(10), chunk_bytes=1 << 20)):
        head, u = update_from_frames(iter(one))
        assert head.version == 1 and torch.equal(u.dense_grad(), torch.arange(10, dtype=torch.float32))
        assert (u.keys, u.batches, u.workers, u.hparams) == (("k1",), ((BatchKey(2, 64), "k1"),), ("w",),
                                                             (("0.lr", 0.5),))
    with pytest.raises(ValueError, match="covers 8 of 10 elements"):
        update_from_frames(iter(fr[:2]))


def test_an_update_with_a_chunk_repeated_is_refused_even_when_the_count_adds_up():
    fr = update_frames(0, "ps-0", an_update(10), chunk_bytes=16)          # [0, 4), [4, 8), [8, 10)
    with pytest.raises(ValueError, match=r"chunk \[0, \+4\) does not continue at 4"):
        update_from_frames(iter([fr[0], fr[0], fr[2]]))                   # 4 + 4 + 2 = 10, wrong data


def test_a_last_chunk_that_claims_more_than_the_shard_is_refused():
    fr = update_frames(0, "ps-0", an_update(10), chunk_bytes=32)          # [0, 8), [8, 10)
    head, _ = frames.unpack(fr[1], pb.ReplicateHeader)
    head.numel = 4                                                       # [8, 12) of 10
    long_tail = frames.pack(head, frames.tensor_bytes(torch.zeros(4)))
    with pytest.raises(ValueError, match="does not continue"):
        update_from_frames(iter([fr[0], long_tail]))


def test_a_chunk_size_under_one_element_still_sends_one_element_a_frame():
    fr = update_frames(0, "ps-0", an_update(3), chunk_bytes=2)
    assert len(fr) == 3
    assert torch.equal(update_from_frames(iter(fr))[1].dense_grad(), torch.arange(3, dtype=torch.float32))


@pytest.mark.parametrize("chunk_bytes", [64, 1])
def test_an_empty_copy_still_travels_as_one_frame(chunk_bytes):
    fr = list(install_frames(1, "ps-0", 5, "fp", b"", chunk_bytes=chunk_bytes))
    assert len(fr) == 1
    head, got = install_from_frames(iter(fr))
    assert (head.shard, head.total_bytes, bytes(got)) == (1, 0, b"")


def test_a_copy_whose_chunks_come_from_two_shards_is_refused():
    data = bytes(range(200))
    ours = list(install_frames(1, "ps-0", 5, "fp", data, chunk_bytes=64))
    theirs = list(install_frames(2, "ps-0", 5, "fp", data, chunk_bytes=64))
    head, got = install_from_frames(iter(ours))
    assert head.shard == 1 and bytes(got) == data
    with pytest.raises(ValueError, match="does not continue"):
        install_from_frames(iter([ours[0], theirs[1], *ours[2:]]))
    with pytest.raises(ValueError, match="carried 192 of 200 bytes"):
        install_from_frames(iter(ours[:-1]))


# ---------------------------------------------------------------- the replicator over gRPC

class GrpcBackup:
    """The backup's data service, in process, as a ps without a TCP data channel answers it."""

    def __init__(self, host: ShardHost):
        self.host, self.calls, self.before_call, self.after_install = host, [], lambda: None, lambda: None
        self.installs = 0

    def _replicate(self, frames):
        self.before_call()
        try:
            head, u = update_from_frames(iter(frames))
            return pb.ReplicateReply(version=self.host.replicate(head, u)).SerializeToString()
        except ShoalError as exc:
            raise Refusal(exc) from None

    def replicate_one(self, frame, timeout=None):
        self.calls.append(("one", 1))
        return self._replicate([frame])

    def replicate(self, frame_iter, timeout=None):
        frames = list(frame_iter)
        self.calls.append(("stream", len(frames)))
        return self._replicate(frames)

    def open_channel(self, request, timeout=None):
        return pb.DataChannelOffer().SerializeToString()         # port 0: no TCP data channel here

    def install(self, frame_iter, timeout=None):
        self.installs += 1
        head, data = install_from_frames(frame_iter)
        reply = pb.ReplicateReply(version=self.host.install_copy(head, data)).SerializeToString()
        self.after_install()
        return reply


@pytest.fixture
def pair():
    """``(primary shard, backup host, stubs, make_replicator)``: a backup holding the primary's copy."""
    primary = Shard(0, torch.zeros(6), SGD, AsyncRule(), "fp")
    backup = ShardHost()
    backup.member_id, backup.job, backup.primary_of = "ps-1", JobConfig(mode="async"), {0: "ps-0"}
    stubs = GrpcBackup(backup)
    stubs.install(install_frames(0, "ps-0", primary.version, primary.fingerprint,
                                 replica_bytes(primary.export_replica()), 1 << 20))
    made = []

    def make(chunk_bytes=1 << 20):
        r = Replicator(0, lambda: "ps-0", lambda: primary, chunk_bytes=chunk_bytes, retry_s=0.01)
        # in step with a backup that offers no TCP channel (what set_target, _data_channel and _install reach)
        r._target, r._stubs, r._negotiated, r._state = ("ps-1", "backup:1"), stubs, True, "in_sync"
        primary.replicator = r
        made.append(r)
        return r

    yield primary, backup, stubs, make
    for r in made:
        r.close()
    backup.close()


@pytest.mark.parametrize("chunk_bytes,calls", [(1 << 20, [("one", 1)] * 2), (8, [("stream", 3)] * 2)],
                         ids=["one-message", "chunked"])
def test_updates_over_grpc_reach_the_backup_whole(pair, chunk_bytes, calls):
    primary, backup, stubs, make = pair
    r = make(chunk_bytes)
    for i, key in enumerate(("k1", "k2")):
        assert primary.push("a", i, torch.linspace(-1, 1, 6), key=key).accepted
    assert stubs.calls == calls and r.transport == "grpc"
    assert backup.shards[0].version == 2 and backup.shards[0].digest() == primary.digest()


def test_an_unreachable_backup_is_retried_with_one_warning_and_the_update_waits_for_it(pair, caplog):
    primary, backup, stubs, make = pair
    make()
    down = [Unavailable("connection refused")] * 3

    def unreachable():
        if down:
            raise Refusal(down.pop())

    stubs.before_call = unreachable
    with caplog.at_level(logging.WARNING, logger="shoal.ps.replication"):
        assert primary.push("a", 0, torch.ones(6), key="k1").accepted
    assert [r.getMessage() for r in caplog.records] == [
        "shard 0: backup ps-1 unreachable (UNAVAILABLE); holding update 1 until it answers or the chief replaces it"]
    assert backup.shards[0].version == 1 and backup.shards[0].digest() == primary.digest()


class Cancelled(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.CANCELLED

    def details(self):
        return "Channel closed!"


@pytest.mark.parametrize("failure", [ValueError("Cannot invoke RPC on closed channel!"), Cancelled()],
                         ids=["before-the-call", "during-the-call"])
def test_an_update_on_its_way_when_the_replicator_is_closed_is_never_acknowledged_or_seen(pair, failure):
    primary, backup, stubs, make = pair
    r = make()

    def closed_under_it():          # the view dropped this copy: close() shut the channel the call was on
        r.close()
        raise failure

    stubs.before_call = closed_under_it
    with pytest.raises(Unavailable, match="dropped"):
        primary.push("a", 0, torch.ones(6), key="k1")
    assert backup.shards[0].version == 0
    refused_from_now_on(primary)


def test_the_primary_applies_an_update_while_it_travels_and_shows_it_once_the_backup_holds_it(pair):
    """Replication off the critical path (issue 16): the primary's own step runs while the update is on
    its way to the backup; neither the push's acknowledgement nor a pull comes before the backup has it."""
    primary, backup, stubs, make = pair
    make()
    applied_meanwhile, release = threading.Event(), threading.Event()

    def in_flight():                                   # the backup's side of the call, in the sender thread
        wait_until(lambda: primary.version == 1, timeout_s=5, what="the primary's own step meanwhile")
        applied_meanwhile.set()
        assert release.wait(10)

    stubs.before_call = in_flight
    acked, pulled = [], []
    pusher = threading.Thread(target=lambda: acked.append(primary.push("a", 0, torch.ones(6), key="k1")),
                              daemon=True)
    pusher.start()
    assert applied_meanwhile.wait(10)
    reader = threading.Thread(target=lambda: pulled.append(primary.snapshot()), daemon=True)
    reader.start()
    pusher.join(0.3)
    reader.join(0.1)
    assert acked == [] and pulled == [] and backup.shards[0].version == 0
    release.set()
    pusher.join(10)
    reader.join(10)
    assert acked[0].accepted and acked[0].version == 1 and pulled[0][0] == 1
    assert backup.shards[0].version == 1 and backup.shards[0].digest() == primary.digest()


def refused_from_now_on(primary):
    """A copy whose update its backup did not take (it applied it while the update was on its way) is
    fenced: no pull or push sees that version, ever."""
    assert primary.fenced
    for call in (lambda: primary.snapshot(), lambda: primary.delta("none", 0),
                 lambda: primary.wait_version(0, 1.0), lambda: primary.push("a", 0, torch.ones(6), key="k2")):
        with pytest.raises(FailedPrecondition, match="not the primary any more"):
            call()


@pytest.mark.parametrize("primary_now,handed_over", [("ps-1", True), ("ps-9", False)],
                         ids=["the-backup-took-over", "a-third-server"])
def test_a_fenced_update_says_handed_over_only_when_its_own_backup_took_over(pair, primary_now, handed_over):
    primary, backup, stubs, make = pair
    make()

    def fenced():
        raise Refusal(FailedPrecondition(f"shard 0's {FENCED} {primary_now}, not ps-0"))

    stubs.before_call = fenced
    with pytest.raises(Unavailable, match=f"{FENCED} {primary_now}") as err:
        primary.push("a", 0, torch.ones(6), key="k1")
    assert (HANDED_OVER in str(err.value)) is handed_over
    refused_from_now_on(primary)


class FlakyCopy(Replicator):
    """A new backup's copy fails as ``answers`` say, then is made (the copy itself is the choke point)."""

    answers: list = []

    def _install_once(self, gen, shard):
        if self.answers:
            raise self.answers.pop(0)
        with self._lock:
            if gen == self._generation:
                self._state = "in_sync"


def test_a_copy_that_fails_is_tried_again_until_the_backup_has_it(caplog):
    shard = Shard(0, torch.zeros(6), SGD, AsyncRule(), "fp")
    r = FlakyCopy(0, lambda: "ps-0", lambda: shard, retry_s=0.01)
    r.answers = [Refusal(FailedPrecondition("ps-0 is not the primary of shard 0 in my view")),
                 Refusal(Unavailable("connection refused"))]
    try:
        with caplog.at_level(logging.INFO, logger="shoal.ps.replication"):
            r.set_target("ps-1", "127.0.0.1:9")
            copiers = [t for t in threading.enumerate() if t.name == "install-0"]
            assert all(t.daemon for t in copiers)     # a copy retried for ever never keeps a stopping ps alive
            wait_until(lambda: r.state == "in_sync", timeout_s=10, what="the copy to be made on the third try")
        tries = [(rec.levelname, rec.getMessage()) for rec in caplog.records if "retrying" in rec.getMessage()]
        assert tries == [("INFO", "shard 0: copy to backup ps-1 failed (FAILED_PRECONDITION); retrying"),
                         ("WARNING", "shard 0: copy to backup ps-1 failed (UNAVAILABLE); retrying")]
    finally:
        r.close()


def test_a_copy_made_after_the_view_dropped_this_copy_never_counts_the_backup_whole(monkeypatch):
    shard = Shard(0, torch.zeros(6), SGD, AsyncRule(), "fp")
    backup = ShardHost()
    backup.member_id, backup.job, backup.primary_of = "ps-1", JobConfig(mode="async"), {0: "ps-0"}
    stubs = GrpcBackup(backup)
    told_whole = []
    r = Replicator(0, lambda: "ps-0", lambda: shard, retry_s=0.01, on_in_sync=lambda: told_whole.append(True))
    stubs.after_install = r.close            # the view dropped this copy while its backup was being filled
    monkeypatch.setattr(replication, "DataStubs", lambda channel: stubs)
    try:
        r.set_target("ps-1", "127.0.0.1:9")
        wait_until(lambda: 0 in backup.shards and not any(t.name == "install-0" for t in threading.enumerate()),
                   timeout_s=10, what="the copy to be made and its thread to end")
        assert r.state == "none" and told_whole == []
    finally:
        r.close()
        backup.close()


def test_an_update_on_its_way_when_the_view_names_another_backup_reaches_the_new_one(pair, monkeypatch):
    primary, backup, stubs, make = pair
    r = make()
    other = ShardHost()
    other.member_id, other.job, other.primary_of = "ps-2", JobConfig(mode="async"), {0: "ps-0"}
    monkeypatch.setattr(replication, "DataStubs", lambda channel: GrpcBackup(other))

    def retargeted():             # the view named ps-2 and closed ps-1's channel as the call was made
        stubs.before_call = lambda: None
        r.set_target("ps-2", "127.0.0.1:9")
        raise ValueError("Cannot invoke RPC on closed channel!")

    stubs.before_call = retargeted
    try:
        assert primary.push("a", 0, torch.ones(6), key="k1").accepted
        wait_until(lambda: r.state == "in_sync", timeout_s=10, what="the new backup's copy")
        assert other.shards[0].version == 1 and other.shards[0].digest() == primary.digest()
        assert primary.push("a", 1, torch.ones(6), key="k2").accepted
        assert other.shards[0].version == 2 and backup.shards[0].version == 0
    finally:
        other.close()


def test_a_data_channel_opened_for_a_backup_the_view_replaced_meanwhile_is_closed(pair, monkeypatch):
    primary, backup, stubs, make = pair
    r = make()
    r._negotiated = False                    # the backup's TCP data channel not asked for yet
    other = ShardHost()
    other.member_id, other.job, other.primary_of = "ps-2", JobConfig(mode="async"), {0: "ps-0"}
    monkeypatch.setattr(replication, "DataStubs", lambda channel: GrpcBackup(other))
    closed = []

    class Channel:
        def close(self):
            closed.append(True)

    def negotiate(stubs_, address, member_id, what, credential):
        r.set_target("ps-2", "127.0.0.1:9")  # the view moved on while the offer was on its way
        return Channel()

    monkeypatch.setattr(replication.tcp_client, "negotiate", negotiate)
    try:
        assert primary.push("a", 0, torch.ones(6), key="k1").accepted
        assert closed == [True]                  # not kept, not leaked
        wait_until(lambda: r.state == "in_sync", timeout_s=10, what="the new backup's copy")
        assert r.transport == ""
    finally:
        other.close()


def test_updates_made_while_a_new_backup_is_filled_all_reach_it_before_it_counts_whole(monkeypatch, caplog):
    primary = Shard(0, torch.zeros(6), SGD, AsyncRule(), "fp")
    backup = ShardHost()
    backup.member_id, backup.job, backup.primary_of = "ps-1", JobConfig(mode="async"), {0: "ps-0"}
    stubs = GrpcBackup(backup)
    monkeypatch.setattr(replication, "DataStubs", lambda channel: stubs)
    r = Replicator(0, lambda: "ps-0", lambda: primary, retry_s=0.01)
    primary.replicator = r
    pushes = iter(range(4))

    def training_goes_on():       # one push after the copy, and one while each of the first three is sent
        i = next(pushes, None)
        if i is not None:
            assert primary.push("a", i, torch.full((6,), float(i + 1)), key=f"k{i}").accepted

    stubs.after_install = stubs.before_call = training_goes_on
    try:
        with caplog.at_level(logging.INFO, logger="shoal.ps.replication"):
            r.set_target("ps-1", "127.0.0.1:9")
            wait_until(lambda: r.state == "in_sync", timeout_s=10, what="the new backup to catch up")
        [took] = [float(m) for m in re.findall(r"in sync from version 0 \(\d+ bytes copied in ([\d.]+)s\)", caplog.text)]
        assert took < 60
        assert primary.version == 4 and backup.shards[0].version == 4
        assert backup.shards[0].digest() == primary.digest()
        assert stubs.calls == [("one", 1)] * 4          # three caught up outside the lock, the last under it
    finally:
        r.close()
        backup.close()


def refuse_first(stubs, *refusals) -> None:
    """The backup's next calls fail with ``refusals``, one each in order; later calls go through."""
    answers = list(refusals)

    def refuse():
        if answers:
            raise answers.pop(0)
    stubs.before_call = refuse


def test_a_backup_that_lost_its_copy_gets_one_fresh_copy_even_when_the_update_after_it_is_retried(pair, caplog):
    primary, backup, stubs, make = pair
    make()
    refuse_first(stubs, Refusal(FailedPrecondition(f"no copy of shard 0 here: {NEEDS_COPY}")),
                 Refusal(Unavailable("connection reset")))
    installs = stubs.installs
    with caplog.at_level(logging.WARNING, logger="shoal.ps.replication"):
        assert primary.push("a", 0, torch.ones(6), key="k1").accepted
    assert stubs.installs - installs == 1
    # at version 1: the primary applied the update while its first send was on its way; the update
    # sent again after the copy is a no-op there
    [took] = [float(m) for m in re.findall(r"sent it a fresh one at version 1 \(\d+ bytes in ([\d.]+)s\)", caplog.text)]
    assert took < 60
    assert backup.shards[0].version == 1 and backup.shards[0].digest() == primary.digest()


def test_a_copy_cut_off_by_its_closed_channel_ends_quietly(monkeypatch):
    shard = Shard(0, torch.zeros(6), SGD, AsyncRule(), "fp")
    r = FlakyCopy(0, lambda: "ps-0", lambda: shard, retry_s=0.01)
    calls = []

    def install_once(gen, shard):
        calls.append(gen)
        if len(calls) == 1:                            # the view moved on and closed this copy's channel
            r.set_target("ps-2", "127.0.0.1:9")
            raise ValueError("Cannot invoke RPC on closed channel!")
        return FlakyCopy._install_once(r, gen, shard)

    unhandled = []
    monkeypatch.setattr(threading, "excepthook", unhandled.append)
    monkeypatch.setattr(r, "_install_once", install_once)
    try:
        r.set_target("ps-1", "127.0.0.1:9")
        wait_until(lambda: r.state == "in_sync" and r.backup == "ps-2", timeout_s=10, what="the second copy")
        wait_until(lambda: not any(t.name == "install-0" for t in threading.enumerate()), timeout_s=10,
                   what="the copy threads to end")
        assert unhandled == [] and len(calls) == 2
    finally:
        r.close()


def test_the_no_backup_timer_never_keeps_a_stopping_ps_alive():
    r = Replicator(5, lambda: "ps-0", lambda: None)
    r.set_target("ps-1", "127.0.0.1:9")
    r.set_target("", "")
    try:
        timers = [t for t in threading.enumerate() if isinstance(t, threading.Timer)]
        assert timers and all(t.daemon for t in timers)
    finally:
        r.close()


def test_an_install_stream_without_a_frame_is_a_sender_that_gave_up_not_a_bad_copy():
    from shoal.ps.replication import NoInstall
    with pytest.raises(NoInstall, match="before its first part"):
        install_from_frames(iter([]))


# ---------------------------------------------------------------- found by the 2026-12-06 run (issue 19)

def test_a_replicator_says_no_transport_before_it_has_asked_a_backup():
    """Mutant: ``self._negotiated = True`` at start (it would say "grpc" before any backup was asked)."""
    r = Replicator(0, lambda: "ps-0", lambda: None)
    try:
        assert r.transport == ""
    finally:
        r.close()


def test_an_overlong_copy_is_refused_at_the_chunk_that_overflows_without_reading_on():
    """Mutant: ``covered - len(payload) > first.total_bytes`` (the buffer would grow past the size the
    copy announced, and the rest of the stream be read, before the final count refuses it)."""
    data = bytes(range(200))
    ours = list(install_frames(1, "ps-0", 5, "fp", data, chunk_bytes=64))      # 64, 64, 64, 8
    head, _ = frames.unpack(ours[3], pb.InstallHeader)
    overlong = frames.pack(head, bytes(64))                                    # [192, 256) of 200
    read = []

    def stream():
        for i, f in enumerate([*ours[:3], overlong, ours[3]]):
            read.append(i)
            yield f

    with pytest.raises(ValueError, match="install chunk at 192 does not continue at 192"):
        install_from_frames(stream())
    assert read == [0, 1, 2, 3]


def test_a_refusal_that_asks_for_no_copy_is_held_and_retried_not_answered_with_a_copy(pair, caplog):
    """Mutant: ``exc.code() == FAILED_PRECONDITION or NEEDS_COPY in details`` (any FAILED_PRECONDITION,
    fenced aside, would send the backup a whole copy under the shard's lock)."""
    primary, backup, stubs, make = pair
    make()
    refuse_first(stubs, Refusal(FailedPrecondition("shard 0 is not initialised yet")))
    installs = stubs.installs
    with caplog.at_level(logging.WARNING, logger="shoal.ps.replication"):
        assert primary.push("a", 0, torch.ones(6), key="k1").accepted
    assert stubs.installs == installs                     # no copy: the update was sent again as it was
    assert [r.getMessage() for r in caplog.records] == [
        "shard 0: backup ps-1 unreachable (FAILED_PRECONDITION); holding update 1 until it answers or the chief "
        "replaces it"]
    assert backup.shards[0].version == 1 and backup.shards[0].digest() == primary.digest()


def test_a_new_backup_is_reached_at_its_address_with_this_servers_credential(monkeypatch):
    """Mutant: ``open_channel(target[0], ...)`` (a channel to the backup's member id, not its address)."""
    opened, closed = [], []

    class Channel:
        def close(self):
            closed.append(True)

    def open_channel(address, credential):
        opened.append((address, credential()))
        return Channel()

    monkeypatch.setattr(replication, "open_channel", open_channel)
    monkeypatch.setattr(replication, "DataStubs", lambda channel: object())
    r = Replicator(0, lambda: "ps-0", lambda: None, retry_s=0.01, credential=lambda: "ps-0's credential")
    try:
        r.set_target("ps-1", "10.0.0.7:4000")
        assert opened == [("10.0.0.7:4000", "ps-0's credential")]
        r.set_target("", "")
        assert closed == [True]
    finally:
        r.close()


RAN = []


def _ran(what):
    RAN.append(what)
    return what


class Payload:
    """Pickles as a call of ``_ran``: what a copy from a rogue sender could carry instead of plain values."""

    def __reduce__(self):
        return (_ran, ("code from the copy",))


def test_a_copy_is_loaded_as_plain_values_never_as_code():
    """Mutant: ``torch.load(..., weights_only=False)`` in replica_from_bytes (a copy's bytes could run code
    in the backup's process)."""
    import io
    import pickle

    buf = io.BytesIO()
    torch.save({"shard": Payload()}, buf)
    RAN.clear()
    with pytest.raises(pickle.UnpicklingError):
        replication.replica_from_bytes(buf.getvalue())
    assert RAN == []
