"""TLS + token: a job trains over TLS (gRPC and the TCP data channel); plaintext and strangers get nowhere."""
import datetime
import ipaddress
import socket

import grpc
import pytest
import torch
import torch.nn.functional as F
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from shoal.security import auth, tls
from shoal.net import tcp_channel as tc
from shoal.settings.config import JobConfig
from shoal.proto import shoal_pb2 as pb
from shoal.proto import shoal_pb2_grpc as pb_grpc
from harness import InProcessCluster
from shoal.worker import Trainer

TOKEN = b"0123456789abcdef-tls-test-token"


def _name(cn):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject, issuer, key, signer, *, ca=False, sans=()):
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if sans:
        b = b.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return b.sign(signer, hashes.SHA256())


def write_pki(d, name="ca"):
    """A CA and one certificate (for 127.0.0.1 and localhost) every role uses; returns their paths."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert(f"shoal test {name}", f"shoal test {name}", ca_key, ca_key, ca=True)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _cert("shoal member", f"shoal test {name}", key, ca_key,
                 sans=(x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))))
    paths = {"ca": d / f"{name}.pem", "cert": d / f"{name}-member.pem", "key": d / f"{name}-member.key"}
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    return {k: str(v) for k, v in paths.items()}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    return write_pki(d), write_pki(d, "other")


@pytest.fixture
def tls_job(pki):
    mine, _ = pki
    tls.configure(tls.TLSConfig(mine["cert"], mine["key"], mine["ca"], mutual=True))
    auth.use_token(TOKEN)
    c = InProcessCluster(1, JobConfig(num_shards=1, mode="async"))
    yield c
    c.stop()
    tls.reset()
    auth.reset()


def test_a_mutual_tls_token_job_trains_over_tls_on_both_transports(tls_job):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    trainer = Trainer(model, chief=tls_job.chief_address, optimizer="adam", lr=0.02)
    try:
        assert all(c.uses_tcp for c in trainer._clients.values())        # the data channel, over TLS
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
        assert tls_job.servers[0].host.get(0).version == 16
    finally:
        trainer.close()


def _status_code(channel):
    with pytest.raises(grpc.RpcError) as err:
        pb_grpc.ChiefStub(channel).GetView(pb.ViewRequest(after_epoch=-1), timeout=3)
    channel.close()
    return err.value.code()


def test_plaintext_and_clients_of_another_ca_cannot_connect(tls_job, pki):
    _, other = pki
    mine, _ = pki
    assert _status_code(grpc.insecure_channel(tls_job.chief_address)) == grpc.StatusCode.UNAVAILABLE
    read = lambda p: open(p, "rb").read()  # noqa: E731
    no_client_cert = grpc.ssl_channel_credentials(root_certificates=read(mine["ca"]))
    assert _status_code(grpc.secure_channel(tls_job.chief_address, no_client_cert)) == grpc.StatusCode.UNAVAILABLE
    foreign = grpc.ssl_channel_credentials(read(mine["ca"]), read(other["key"]), read(other["cert"]))
    assert _status_code(grpc.secure_channel(tls_job.chief_address, foreign)) == grpc.StatusCode.UNAVAILABLE
    # the data channel speaks TLS only: a plaintext HELLO gets a TLS alert or a closed connection, never OK
    offer = tls_job.servers[0].data.offer
    with socket.create_connection(("127.0.0.1", offer.port), timeout=5) as sock:
        sock.sendall(tc.PREFIX.pack(tc.HELLO, len(offer.ticket), 0) + offer.ticket)
        try:
            answer = sock.recv(64)            # a server waiting for more would time this out (an error)
        except ConnectionResetError:
            answer = b""
    assert answer[:1] in (b"", b"\x15")                 # nothing, or a TLS alert record


def test_tls_settings_are_checked_up_front(tmp_path, pki):
    mine, _ = pki
    with pytest.raises(Exception, match="go together"):
        tls.TLSConfig(cert=mine["cert"])
    with pytest.raises(Exception, match="needs --tls-ca"):
        tls.TLSConfig(cert=mine["cert"], key=mine["key"], mutual=True)
    with pytest.raises(Exception, match="not a readable file"):
        tls.TLSConfig(ca=str(tmp_path / "missing.pem"))
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate")
    with pytest.raises(Exception, match="cannot load TLS material"):
        tls.TLSConfig(ca=str(bad)).client_context()


def test_shoal_health_speaks_tls_to_a_tls_role(tls_job, pki, capsys, monkeypatch):
    """The compose health checks run ``shoal health`` in the role's own environment (its SHOAL_TLS_*)."""
    from shoal.cli.main import main

    mine, _ = pki
    for name in ("cert", "key", "ca"):
        monkeypatch.setenv(tls.ENV[name], mine[name])
    monkeypatch.setenv(tls.ENV["mutual"], "1")
    assert main(["health", tls_job.chief_address]) == 0
    assert "SERVING" in capsys.readouterr().out
