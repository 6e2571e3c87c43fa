"""The job token file and member credentials (shoal.security.auth), without sockets."""
import os

import pytest

from shoal.security import auth, tokens
from shoal.cli import security
from shoal.errors import InvalidArgument


@pytest.fixture(autouse=True)
def no_token(monkeypatch):
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    auth.reset()
    yield
    auth.reset()


def test_a_written_token_is_private_and_reads_back(tmp_path, caplog):
    path = auth.write_token_file(tmp_path / "job.token")
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert len(auth.read_token_file(path)) == 64 and not caplog.records


@pytest.mark.parametrize("text,why", [("", "printable"), ("short", "16 to"), ("a b" * 10, "without spaces")])
def test_bad_token_files_are_one_line_errors(tmp_path, text, why):
    path = tmp_path / "t"
    path.write_text(text)
    with pytest.raises(InvalidArgument, match=why):
        auth.read_token_file(path)
    with pytest.raises(InvalidArgument, match="cannot read the token file"):
        auth.read_token_file(tmp_path / "missing")


def test_a_token_readable_by_others_is_used_with_a_warning(tmp_path, caplog):
    path = tmp_path / "t"
    path.write_text("x" * 32)
    path.chmod(0o644)
    assert auth.read_token_file(path) == b"x" * 32
    assert "chmod 600" in caplog.text and "x" * 32 not in caplog.text      # the token itself is never logged


def test_the_token_comes_from_the_environment_once(tmp_path, monkeypatch):
    assert auth.job_token() is None
    path = auth.write_token_file(tmp_path / "t")
    monkeypatch.setenv(auth.TOKEN_ENV, str(path))
    assert auth.job_token() is None                   # read once per process...
    auth.reset()
    assert auth.job_token() == path.read_text().strip().encode()


def test_credentials_verify_only_under_their_chiefs_key_and_for_their_member():
    secret = b"s" * 32
    key = tokens.public_key(secret)
    cred = auth.issue(secret, "worker-3", auth.WORKER)
    assert auth.verify(key, cred) == auth.Caller("worker-3", auth.WORKER)
    assert auth.verify(tokens.public_key(b"t" * 32), cred) is None         # another job's chief
    role, member, proof = cred.split(":")
    assert auth.verify(key, f"{auth.PS}:{member}:{proof}") is None          # the role is signed
    assert auth.verify(key, f"{role}:worker-4:{proof}") is None             # so is the member
    for junk in ("", ":", "worker", "worker::", "a:b:c:d", f"{role}:{member}:{'0' * 128}", f"{role}:{member}:zz"):
        assert auth.verify(key, junk) is None


def test_what_a_parameter_server_holds_cannot_make_a_credential():
    """A ps gets the chief's public key: signing with it (as if it were the secret) makes nothing that
    verifies, and neither does a token signature passed off as a credential."""
    secret = b"s" * 32
    key = tokens.public_key(secret)
    assert auth.verify(key, auth.issue(key, auth.OPERATOR_ID, auth.OPERATOR)) is None
    task_sig = tokens.sign(secret, "worker-3", 1, 1, 0, 0, 8).hex()
    assert auth.verify(key, f"{auth.WORKER}:worker-3:{task_sig}") is None


@pytest.mark.parametrize("bind,loopback", [("127.0.0.1:7070", True), ("[::1]:1", True), ("localhost:1", True),
                                           ("0.0.0.0:7070", False), ("10.0.0.5:1", False), ("myhost:1", False)])
def test_only_non_loopback_binds_warn(bind, loopback, caplog):
    security.warn_if_exposed("shoal chief", bind)
    assert bool(caplog.records) is not loopback
    if not loopback:
        assert "without TLS or a job token" in caplog.text
