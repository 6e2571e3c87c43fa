"""Hypothesis throws malformed, truncated, oversized and random requests at every RPC of the chief and
the ps and at the TCP data channel of a token job, over real sockets: no call is INTERNAL, nothing in
the job changes, every role stays up, memory stays bounded. ``bench/fuzz.py`` runs the same longer."""
import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzzing import (BAD_CODES, CHIEF_METHODS, DATA_METHODS, PS_METHODS, STREAMING, Target, data_frames,
                     messages, rss_mb, tcp_messages)
from shoal.net import tcp_channel as tc

FAST = settings(max_examples=40, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def target():
    t = Target.start()
    t.rss0 = rss_mb()
    t.before = t.state()
    yield t
    assert t.alive(), "a role stopped answering"
    assert t.state() == t.before, "a bad call changed the job"
    assert rss_mb() - t.rss0 < 300, f"memory grew by {rss_mb() - t.rss0:.0f} MB"
    t.stop()


@pytest.mark.parametrize("method", sorted(CHIEF_METHODS))
def test_chief_rpcs(target, method):
    @FAST
    @given(messages(CHIEF_METHODS[method]), st.booleans())
    def check(request, credential):
        # as an outsider with the token, or as a worker the chief issued a credential to (not a member now:
        # a member's own Leave or heartbeat would be a legitimate change)
        cred = target.worker if credential else ""
        before = target.state()
        code = target.call("chief", method, [request], cred)
        assert code not in BAD_CODES
        if method != "Join":            # a well-formed join by a token holder may add a member: that is a join
            assert target.state() == before
    check()
    if method == "Join":                # forget what well-formed joins added
        target.before = target.state()


@pytest.mark.parametrize("method", sorted(PS_METHODS))
def test_ps_control_rpcs(target, method):
    @FAST
    @given(messages(PS_METHODS[method][1]))
    def check(request):
        before = target.state()
        code = target.call("ps", method, [request], target.worker)
        assert code not in BAD_CODES
        if method in ("Freeze", "WriteShard", "Thaw"):
            assert code != grpc.StatusCode.OK          # a worker's credential never reaches these
        assert target.state() == before
    check()


@pytest.mark.parametrize("method", sorted(DATA_METHODS))
def test_ps_data_rpcs(target, method):
    @FAST
    @given(st.lists(data_frames(DATA_METHODS[method]), min_size=1, max_size=3 if method in STREAMING else 1))
    def check(requests):
        before = target.state()
        code = target.call("ps", method, requests, target.ps)      # a server's credential: past the role check
        assert code not in BAD_CODES
        if method not in ("OpenChannel", "Pull", "PullOne"):
            assert code != grpc.StatusCode.OK
        assert target.state() == before
    check()


def test_tcp_data_channel(target):
    @settings(FAST, max_examples=120)
    @given(st.lists(tcp_messages(), min_size=1, max_size=3), st.booleans())
    def check(chunks, hello):
        before = target.state()
        kinds, _ = target.tcp(chunks, hello)
        assert all(tc.status_code(k) not in BAD_CODES for k in kinds)
        if not hello:
            assert tc.OK not in kinds                   # no HELLO, no service
        assert target.state() == before
    check()
