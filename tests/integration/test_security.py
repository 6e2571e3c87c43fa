"""A job with a token: it trains as before, and each attack of issue 12 is refused with nothing changed."""
import socket
import time

import grpc
import pytest
import torch
import torch.nn.functional as F
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shoal.security import auth, tokens
from shoal.net import frames
from shoal.net import tcp_channel as tc
from shoal.settings.config import JobConfig
from shoal.proto import shoal_pb2 as pb
from shoal.proto import shoal_pb2_grpc as pb_grpc
from shoal.ps.replication import install_frames
from shoal.net.wire import DataStubs
from harness import InProcessCluster, wait_until
from shoal.worker import Trainer

TOKEN = b"0123456789abcdef-test-token"


@pytest.fixture
def secure():
    """A 2-shard sync job (each shard with a backup) whose every role requires the token, and one worker."""
    auth.use_token(TOKEN)
    c = InProcessCluster(2, JobConfig(num_shards=2, mode="sync"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    trainer = Trainer(model, chief=c.chief_address, optimizer="adam", lr=0.02)
    # every backup complete, so the view epoch stays put unless a test's call changes it
    wait_until(lambda: all(r.backup_id and r.backup_complete for r in trainer.chief.view.shards),
               what="complete backups in the view")
    yield c, trainer, model
    trainer.close()
    c.stop()
    auth.reset()


def channel(address, token=TOKEN, credential=""):
    """A channel sending ``token`` (None: nothing) and ``credential``."""
    raw = grpc.insecure_channel(address)
    if token is None:
        return raw
    auth.use_token(token)
    try:
        return auth.authenticated(raw, lambda: credential)
    finally:
        auth.use_token(TOKEN)


def code_of(call):
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def operator(c):
    return auth.issue(c.chief.state.secret, auth.OPERATOR_ID, auth.OPERATOR)


def test_a_token_job_trains_with_its_backups_in_step(secure):
    c, trainer, model = secure
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 8, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    before = F.cross_entropy(model(x), y).item()
    for xb, yb in trainer.batches((x, y), batch_size=16, epochs=2):
        trainer.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        trainer.step(samples=len(xb))
    trainer.pull()
    assert F.cross_entropy(model(x), y).item() < before
    assert trainer.chief.credential.startswith("worker:")
    for k in range(2):
        copies = [ps.host.shards[k].digest() for ps in c.servers if k in ps.host.shards]
        assert len(copies) == 2 and copies[0] == copies[1] and copies[0][0] == 16   # primary == backup


@pytest.mark.parametrize("token", [None, b"0123456789abcdef-wrong-token"])
def test_calls_without_the_right_token_are_unauthenticated_and_change_nothing(secure, token):
    c, trainer, _ = secure
    ch, ps = channel(c.chief_address, token), channel(c.servers[0].address, token)
    chief = pb_grpc.ChiefStub(ch)
    epoch = c.chief.state.epoch
    assert code_of(lambda: chief.GetView(pb.ViewRequest(after_epoch=-1), timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: chief.Join(pb.JoinRequest(role=pb.PS, address="127.0.0.1:1"), timeout=5)) == \
        grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: chief.Leave(pb.LeaveRequest(member_id="ps-0"), timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
    stubs = DataStubs(ps)
    assert code_of(lambda: stubs.open_channel(b"", timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
    huge = pb.InstallHeader(shard=0, total_bytes=1 << 30, primary_id="ps-1")        # the 22-byte 1 GiB Install
    assert code_of(lambda: stubs.install(iter([frames.pack(huge, b"")]), timeout=5)) == grpc.StatusCode.UNAUTHENTICATED
    # the health service stays open for probes and load balancers
    health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert c.chief.state.epoch == epoch and c.chief.state.members.get("ps-0").live
    ch.close()
    ps.close()


def test_a_worker_cannot_act_as_a_server_the_operator_or_another_member(secure):
    c, trainer, _ = secure
    me = trainer.chief.credential
    ps_cred = c.servers[0].host.credential
    chief = pb_grpc.ChiefStub(channel(c.chief_address, credential=me))
    denied = grpc.StatusCode.PERMISSION_DENIED
    epoch = c.chief.state.epoch
    assert code_of(lambda: chief.Leave(pb.LeaveRequest(member_id="ps-0"), timeout=5)) == denied
    assert code_of(lambda: chief.Heartbeat(pb.HeartbeatRequest(member_id="ps-0"), timeout=5)) == denied
    assert code_of(lambda: chief.ReportMetrics(pb.MetricsReport(member_id="chief", values={"test_accuracy": 0.0123}),
                                               timeout=5)) == denied
    assert code_of(lambda: pb_grpc.ChiefStub(channel(c.chief_address, credential=ps_cred)).GetTasks(
        pb.TaskRequest(member_id="ps-0", max_tasks=10_000), timeout=5)) == denied
    assert c.chief.state.epoch == epoch and c.chief.state.members.get("ps-0").live
    assert "test_accuracy" not in c.chief.state.metrics
    # a forged credential (right shape, wrong key) is no credential
    forged = auth.issue(b"not the job's key", "ps-0", auth.PS)
    for cred in (me, forged, ps_cred):
        control = pb_grpc.ShardControlStub(channel(c.servers[0].address, credential=cred))
        assert code_of(lambda: control.Freeze(pb.FreezeRequest(shard=0, timeout_seconds=1, hold_seconds=600),
                                              timeout=5)) == denied
    for cred in (me, forged):
        stubs = DataStubs(channel(c.servers[1].address, credential=cred))
        assert code_of(lambda: stubs.install(install_frames(0, "ps-0", 1, "fp", b"x" * 64, 1 << 20),
                                             timeout=5)) == denied
    assert code_of(lambda: pb_grpc.ChiefStub(channel(c.chief_address, credential=forged)).Leave(
        pb.LeaveRequest(member_id="ps-0"), timeout=5)) == denied


def test_a_worker_is_refused_replication_over_the_tcp_channel(secure):
    c, trainer, _ = secure
    backup = next(ps for ps in c.servers if ps.host.roles.get(0) == "backup")
    wait_until(lambda: 0 in backup.host.shards, what="the backup's copy")
    before = backup.host.shards[0].digest()
    offer = pb.DataChannelOffer.FromString(DataStubs(channel(backup.address)).open_channel(b"", timeout=5))
    with socket.create_connection(("127.0.0.1", offer.port), timeout=5) as sock:
        tc.send(sock, tc.HELLO, tc.hello(offer.ticket, trainer.member_id, trainer.chief.credential))
        assert tc.recv_prefix(sock)[0] == tc.OK
        n = backup.host.shards[0].numel
        head = pb.ReplicateHeader(shard=0, version=before[0] + 1, primary_id="ps-0", numel=n, shard_numel=n)
        tc.send(sock, tc.REPLICATE, head.SerializeToString(), torch.full((n,), 1e3).numpy().tobytes())
        kind, text, _ = tc.recv_prefix(sock)
    assert tc.status_code(kind) == grpc.StatusCode.PERMISSION_DENIED, text
    assert backup.host.shards[0].digest() == before


def test_a_push_is_accepted_only_from_the_worker_it_names(secure):
    """Another member of the job (token and credential of its own) pushing under this worker's name is
    refused on both transports, before anything is applied: a claim on a batch is the holder's alone."""
    c, trainer, _ = secure
    other = Trainer(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)),
                    chief=c.chief_address, optimizer="adam", lr=0.02)
    try:
        ps = next(p for p in c.servers if p.host.roles.get(0) == "primary")
        shard = ps.host.shards[0]
        before = shard.digest()
        head = pb.PushHeader(shard=0, worker_id=trainer.member_id, version=shard.version, key="forged",
                             numel=shard.numel, layout_fingerprint=shard.fingerprint, codec="none")
        body = torch.ones(shard.numel).numpy().tobytes()
        stubs = DataStubs(channel(ps.address, credential=other.chief.credential))
        assert code_of(lambda: stubs.push_one(frames.pack(head, body), timeout=5)) == \
            grpc.StatusCode.PERMISSION_DENIED
        offer = pb.DataChannelOffer.FromString(stubs.open_channel(b"", timeout=5))
        with socket.create_connection(("127.0.0.1", offer.port), timeout=5) as sock:
            tc.send(sock, tc.HELLO, tc.hello(offer.ticket, other.member_id, other.chief.credential))
            assert tc.recv_prefix(sock)[0] == tc.OK
            tc.send(sock, tc.PUSH, head.SerializeToString(), body)
            kind, text, _ = tc.recv_prefix(sock)
        assert tc.status_code(kind) == grpc.StatusCode.PERMISSION_DENIED, text
        assert shard.digest() == before
    finally:
        other.close()


def test_a_server_that_joins_gets_a_key_that_verifies_but_cannot_sign(secure):
    """The attack of the issue: join as a ps and use what the chief hands over to forge claims on
    batches. A ps now gets the chief's public key; the secret is nowhere in the reply, and tokens
    made with what it got do not verify."""
    c, trainer, _ = secure
    chief = pb_grpc.ChiefStub(channel(c.chief_address))
    reply = chief.Join(pb.JoinRequest(role=pb.PS, address="127.0.0.1:9"), timeout=5)
    secret = c.chief.state.secret
    assert reply.verify_key == tokens.public_key(secret) and secret not in reply.SerializeToString()
    fields = dict(member=trainer.member_id, task_id=0, attempt=1, epoch=0, start=0, stop=64)
    assert tokens.verify(reply.verify_key, tokens.sign(secret, **fields), **fields)
    assert not tokens.verify(reply.verify_key, tokens.sign(reply.verify_key, **fields), **fields)
    assert auth.verify(reply.verify_key, auth.issue(reply.verify_key, auth.OPERATOR_ID, auth.OPERATOR)) is None


def test_data_channel_connections_opened_under_an_old_credential_are_not_reused(secure):
    """A re-join (the chief dropped the worker) changes its name and credential, and a ps judges a
    connection's pushes by its hello's credential: connections opened under the old one are closed,
    not reused."""
    c, trainer, _ = secure
    tcp = trainer._clients[0].tcp
    first = tcp.call(lambda sock: sock, timeout_s=5)
    assert tcp.call(lambda sock: sock, timeout_s=5) is first
    tcp.credential = lambda: "worker:worker-7:" + "0" * 128          # as after a re-join
    again = tcp.call(lambda sock: sock, timeout_s=5)
    assert again is not first and first.fileno() == -1


def test_a_peer_that_trickles_its_hello_is_cut_off(secure):
    c, _, _ = secure
    server = c.servers[0].channel
    server.hello_timeout_s = 0.5
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        t0 = time.monotonic()
        closed = False
        sock.sendall(tc.PREFIX.pack(tc.HELLO, 60, 0))       # a HELLO whose 60-byte head comes a byte at a time
        while time.monotonic() - t0 < 5:
            try:
                sock.send(b"\x00")
                time.sleep(0.1)
            except OSError:
                closed = True
                break
            sock.settimeout(0.01)
            try:
                if sock.recv(1) == b"":
                    closed = True
                    break
            except (socket.timeout, BlockingIOError):
                pass
    assert closed and time.monotonic() - t0 < 4.5         # cut after 0.5 s, not after the 6 s the bytes take


@pytest.mark.parametrize("address", ["x" * 300 + ":1", "../../etc/passwd", "host:99999", ""])
def test_a_ps_join_with_a_bad_address_is_invalid(secure, address):
    c, _, _ = secure
    chief = pb_grpc.ChiefStub(channel(c.chief_address))
    members = len(list(c.chief.state.members.all()))
    assert code_of(lambda: chief.Join(pb.JoinRequest(role=pb.PS, address=address), timeout=5)) == \
        grpc.StatusCode.INVALID_ARGUMENT
    assert len(list(c.chief.state.members.all())) == members


def test_a_join_under_another_members_id_gets_its_own(secure):
    c, trainer, _ = secure
    chief = pb_grpc.ChiefStub(channel(c.chief_address))
    layout = trainer.chief.layout
    reply = chief.Join(pb.JoinRequest(role=pb.WORKER, layout=layout, member_id=trainer.member_id), timeout=5)
    assert reply.member_id != trainer.member_id and reply.credential.startswith(f"worker:{reply.member_id}:")
    assert not reply.verify_key                              # a worker is not even given the public key


def test_garbage_and_huge_waits_are_invalid_argument_never_internal(secure, caplog):
    c, _, _ = secure
    auth.REFUSALS.reset()                       # earlier tests' refusals must not silence these
    ch = channel(c.chief_address)
    garbage = ch.unary_unary("/shoal.Chief/Join")               # bytes that are no JoinRequest
    for _ in range(5):
        assert code_of(lambda: garbage(b"\xff\xff\xff\xff", timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT
    control = pb_grpc.ShardControlStub(channel(c.servers[0].address, credential=operator(c)))
    for t in (1e300, float("nan"), -1.0):
        assert code_of(lambda: control.Freeze(pb.FreezeRequest(shard=0, timeout_seconds=t), timeout=5)) == \
            grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: control.Freeze(pb.FreezeRequest(shard=0, hold_seconds=1e300), timeout=5)) == \
        grpc.StatusCode.INVALID_ARGUMENT
    assert not any(r.levelname == "ERROR" for r in caplog.records)
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert 1 <= len(refusals) <= 3                              # rate-limited, not one per call


def test_a_message_over_the_cap_is_refused_before_it_reaches_a_servicer(monkeypatch):
    from shoal.net import rpc

    options = [o for o in rpc.SERVER_OPTIONS if o[0] != "grpc.max_receive_message_length"]
    monkeypatch.setattr(rpc, "SERVER_OPTIONS", options + [("grpc.max_receive_message_length", 1 << 20)])
    server, port, _ = rpc.create_server("127.0.0.1:0")
    server.start()
    try:
        ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=rpc.MESSAGE_OPTIONS)
        check = health_pb2_grpc.HealthStub(ch).Check
        assert code_of(lambda: check(health_pb2.HealthCheckRequest(service="x" * (2 << 20)), timeout=5)) == \
            grpc.StatusCode.RESOURCE_EXHAUSTED
        assert check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
        ch.close()
    finally:
        server.stop(0)


def _cut_within(sock, seconds):
    """Whether the server closes ``sock`` within ``seconds`` (polled, not slept)."""
    deadline = time.monotonic() + seconds
    sock.settimeout(0.05)
    while time.monotonic() < deadline:
        try:
            if sock.recv(1 << 16) == b"":
                return True
        except socket.timeout:
            continue
        except OSError:
            return True
    return False


def test_a_connection_silent_after_its_hello_or_stalling_in_a_head_is_cut(secure):
    c, trainer, _ = secure
    server = c.servers[0].channel
    server.hello_timeout_s = 0.5
    ticket = server.ticket
    for then in (b"", tc.PREFIX.pack(tc.PULL, tc.MAX_HEAD, 0)):   # nothing; a large head announced, never sent
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            tc.send(sock, tc.HELLO, tc.hello(ticket, trainer.member_id, trainer.chief.credential))
            kind, _, _ = tc.recv_prefix(sock, deadline=time.monotonic() + 5)
            assert kind == tc.OK
            sock.sendall(then)
            assert _cut_within(sock, 4.0), then


def test_an_idle_pooled_connection_cut_by_the_server_is_replaced_at_the_next_call(secure):
    import select

    c, trainer, model = secure
    for ps in c.servers:
        ps.channel.idle_timeout_s = 0.3
    x, y = torch.randn(32, 8), torch.zeros(32, dtype=torch.long)

    def step(xb, yb):
        trainer.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        trainer.step()
    batches = trainer.batches((x, y), batch_size=16, epochs=1)
    step(*next(batches))                          # the connections' first requests: now they idle
    tcp = trainer._clients[0].tcp
    pooled = tcp.call(lambda sock: sock, timeout_s=5)
    wait_until(lambda: select.select([pooled], [], [], 0)[0], timeout_s=10,
               what="the server to cut the idle connection")
    step(*next(batches))
    assert trainer.routes.failovers == 0 and pooled.fileno() == -1      # replaced, not used
