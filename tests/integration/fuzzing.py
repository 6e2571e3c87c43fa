"""Malformed, truncated, oversized and random messages for every RPC of every role and for the TCP data
channel, over real sockets (shared by tests/integration/test_fuzz.py and bench/fuzz.py).

A :class:`Target` is a live token job (chief + one ps holding an initialised shard with a backup-less
primary) and the credentials an insider has. :meth:`Target.state` is what must not change.
"""
from __future__ import annotations

import hashlib
import socket
from dataclasses import dataclass, field

import grpc
import torch
from hypothesis import strategies as st

from shoal.security import auth
from shoal.net import frames
from shoal.net import tcp_channel as tc
from shoal.settings.config import JobConfig, OptimizerSpec
from shoal.proto import shoal_pb2 as pb
from shoal.net.wire import DATA_SERVICE
from harness import InProcessCluster

TOKEN = b"fuzzing-token-0123456789"
BAD_CODES = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)

CHIEF_METHODS = {"Join": pb.JoinRequest, "Heartbeat": pb.HeartbeatRequest, "Leave": pb.LeaveRequest,
                 "GetView": pb.ViewRequest, "GetTasks": pb.TaskRequest, "ReportMetrics": pb.MetricsReport,
                 "GetJobStats": pb.Empty, "ReportUnreachable": pb.UnreachableReport}
PS_METHODS = {"Status": ("/shoal.ParameterServer/Status", pb.StatusRequest),
              "Digest": ("/shoal.ShardControl/Digest", pb.DigestRequest),
              "Freeze": ("/shoal.ShardControl/Freeze", pb.FreezeRequest),
              "WriteShard": ("/shoal.ShardControl/WriteShard", pb.WriteShardRequest),
              "Thaw": ("/shoal.ShardControl/Thaw", pb.ThawRequest)}
DATA_METHODS = {"Init": pb.InitHeader, "Push": pb.PushHeader, "PushOne": pb.PushHeader, "Pull": None,
                "PullOne": None, "Replicate": pb.ReplicateHeader, "ReplicateOne": pb.ReplicateHeader,
                "Install": pb.InstallHeader, "OpenChannel": None}
STREAMING = {"Init", "Push", "Replicate", "Install"}

ints = st.one_of(st.integers(-3, 3), st.integers(-(1 << 31), (1 << 31) - 1), st.sampled_from([1 << 30, 1 << 40]))
text = st.one_of(st.sampled_from(["", "none", "fp16", "bf16", "topk", "int8", "sign+lz4", "fp", "ps-0", "w"]),
                 st.text(max_size=40))


def headers(kind):
    """Well-formed headers of ``kind`` with hostile values: sizes, offsets, versions, codecs."""
    fields = {f.name: f for f in kind.DESCRIPTOR.fields}
    kwargs = {}
    for name, f in fields.items():
        if getattr(f, "is_repeated", False) or f.message_type is not None:
            continue
        if f.type in (f.TYPE_INT32, f.TYPE_INT64, f.TYPE_UINT32, f.TYPE_UINT64, f.TYPE_ENUM):
            lo = 0 if f.type in (f.TYPE_UINT32, f.TYPE_UINT64) else None
            kwargs[name] = ints.filter(lambda v, lo=lo, t=f.type: (lo is None or v >= 0)
                                       and (t != f.TYPE_INT32 or -(1 << 31) <= v < (1 << 31))
                                       and (t != f.TYPE_ENUM or 0 <= v < 3))
        elif f.type == f.TYPE_STRING:
            kwargs[name] = text
        elif f.type == f.TYPE_BYTES:
            kwargs[name] = st.binary(max_size=40)
        elif f.type == f.TYPE_BOOL:
            kwargs[name] = st.booleans()
        elif f.type in (f.TYPE_DOUBLE, f.TYPE_FLOAT):
            kwargs[name] = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1e300]))
    return st.fixed_dictionaries({}, optional=kwargs).map(lambda kw: kind(**kw))


def messages(kind):
    """Bytes for a request of ``kind``: random, a hostile header, or a valid one truncated."""
    if kind is None:
        return st.binary(max_size=200)
    return st.one_of(st.binary(max_size=200), headers(kind).map(lambda m: m.SerializeToString()),
                     st.tuples(headers(kind), st.integers(0, 64)).map(lambda t: t[0].SerializeToString()[:t[1]]))


def data_frames(kind):
    """Frames of the data plane: random, or a hostile header with a random, empty or short payload."""
    if kind is None:
        return messages(None)
    payload = st.one_of(st.just(b""), st.binary(max_size=64), st.integers(0, 4096).map(lambda n: b"\x00" * n))
    framed = st.tuples(headers(kind), payload).map(lambda t: frames.pack(*t))
    return st.one_of(st.binary(max_size=200), framed, st.tuples(framed, st.integers(0, 40)).map(lambda t: t[0][:t[1]]))


@dataclass
class Target:
    cluster: InProcessCluster
    worker: str                     # a worker's credential, as the chief issued it
    ps: str                         # the ps's own
    members: frozenset = frozenset()
    channels: dict = field(default_factory=dict)

    @classmethod
    def start(cls) -> "Target":
        auth.use_token(TOKEN)
        c = InProcessCluster(1, JobConfig(num_shards=1, mode="async", replicas=1))
        from shoal.worker.ps_client import ShardClient

        ps = c.servers[0]
        fp = "fuzz-layout"
        ShardClient(0, ps.address, 1000, fp, transport="grpc").init(torch.zeros(1000), OptimizerSpec())
        key = c.chief.state.secret
        members = frozenset(m.member_id for m in c.chief.state.members.all())
        return cls(c, auth.issue(key, "worker-9", auth.WORKER), ps.host.credential, members)

    def stop(self) -> None:
        for ch in self.channels.values():
            ch.close()
        self.cluster.stop()
        auth.reset()

    def channel(self, where: str, credential: str) -> grpc.Channel:
        key = (where, credential)
        if key not in self.channels:
            address = self.cluster.chief_address if where == "chief" else self.cluster.servers[0].address
            self.channels[key] = auth.authenticated(grpc.insecure_channel(address), lambda: credential)
        return self.channels[key]

    def state(self) -> tuple:
        """Everything a bad call must leave alone: the job's members, routing, tasks, metrics, the shard
        (its weights, optimizer state and version) and its pushes. Members that fuzzed joins added (and
        whose leases then run out) are not the job's."""
        s = self.cluster.chief.state
        shard = self.cluster.servers[0].host.shards[0]
        return (sorted((m.member_id, m.live) for m in s.members.all() if m.member_id in self.members),
                dict(s.routing), s.tasks.done_count, dict(s.metrics), shard.digest(), shard.stats.pushes_applied,
                shard.nonfinite_counts())

    def call(self, where: str, method: str, requests: list[bytes], credential: str) -> grpc.StatusCode:
        ch = self.channel(where, credential)
        if where == "chief":
            path = f"/shoal.Chief/{method}"
        elif method in PS_METHODS:
            path = PS_METHODS[method][0]
        else:
            path = f"/{DATA_SERVICE}/{method}"
        # a GetView naming a future epoch is a watch that waits for its timeout_seconds (drawn up to any
        # size): half a second shows whether the chief takes it (DEADLINE_EXCEEDED) without waiting it out
        timeout = 0.5 if method == "GetView" else 5
        try:
            if method in STREAMING:
                ch.stream_unary(path)(iter(requests), timeout=timeout)
            elif method == "Pull":
                list(ch.unary_stream(path)(requests[0], timeout=timeout))
            else:
                ch.unary_unary(path)(requests[0], timeout=timeout)
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    def tcp(self, chunks: list[bytes], hello: bool) -> tuple[list[int], bool]:
        """Sends ``chunks`` on a data connection (after a valid HELLO when ``hello``); returns the reply
        kinds read and whether the server closed the connection."""
        ps = self.cluster.servers[0]
        offer = ps.data.offer
        kinds, closed = [], False
        with socket.create_connection(("127.0.0.1", offer.port), timeout=5) as sock:
            sock.settimeout(0.5)
            if hello:
                tc.send(sock, tc.HELLO, tc.hello(offer.ticket, "worker-9", self.worker))
                kinds.append(tc.recv_prefix(sock)[0])
            try:
                for c in chunks:
                    sock.sendall(c)
                sock.shutdown(socket.SHUT_WR)
                while True:
                    kind, head, body = tc.recv_prefix(sock)
                    kinds.append(kind)
                    tc.discard(sock, body)
            except (ConnectionError, OSError):
                closed = True
        return kinds, closed

    def alive(self) -> bool:
        """The ps still serves a real pull over TCP, and the chief its view."""
        from shoal.worker.ps_client import ShardClient

        c = ShardClient(0, self.cluster.servers[0].address, 1000, "fuzz-layout")
        try:
            version, _ = c.pull(torch.empty(1000))
            view = self.channel("chief", self.worker).unary_unary("/shoal.Chief/GetView")(
                pb.ViewRequest(after_epoch=-1).SerializeToString(), timeout=5)
            return version >= 0 and bool(view)
        finally:
            c.close()


def tcp_messages():
    """Data-channel messages: a prefix (any kind, head and body sizes) and some of what it announces."""
    kinds = st.sampled_from([tc.HELLO, tc.PUSH_MORE, tc.PUSH, tc.PULL, tc.REPLICATE, 0, 9, 255])
    head = st.one_of(st.binary(max_size=64), headers(pb.PushHeader).map(lambda m: m.SerializeToString()),
                     headers(pb.ReplicateHeader).map(lambda m: m.SerializeToString()),
                     headers(pb.PullRequest).map(lambda m: m.SerializeToString()))

    def build(kind, h, claimed_body, body, claim_head):
        head_len = len(h) if claim_head is None else claim_head
        return tc.PREFIX.pack(kind, head_len, claimed_body) + h + body

    return st.builds(build, kinds, head, st.one_of(st.integers(0, 64), st.sampled_from([1 << 30, (1 << 64) - 1])),
                     st.binary(max_size=64), st.one_of(st.none(), st.sampled_from([0, 1 << 20, (1 << 32) - 1])))


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2 ** 20


def digest(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()[:12]
