"""A throw-away CA and one member certificate for ``shoal local --secure``, made with ``openssl``
(the same commands as the README's recipe)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from shoal.errors import ShoalError

EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def make_local_pki(directory: Path, days: int = 7) -> dict[str, str]:
    """CA, certificate and key (for 127.0.0.1 and localhost) under ``directory``; their paths by name."""
    if shutil.which("openssl") is None:
        raise ShoalError("--secure makes TLS certificates with the openssl command, which is not installed")
    d = Path(directory)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    ext = d / "member.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n")
    steps = [
        ["req", "-x509", *EC, "-keyout", "ca.key", "-out", "ca.pem", "-days", str(days), "-subj", "/CN=shoal local CA"],
        ["req", *EC, "-keyout", "member.key", "-out", "member.csr", "-subj", "/CN=shoal local member"],
        ["x509", "-req", "-in", "member.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
         "-out", "member.pem", "-days", str(days), "-extfile", ext.name],
    ]
    for args in steps:
        done = subprocess.run(["openssl", *args], cwd=d, capture_output=True, text=True)
        if done.returncode != 0:
            raise ShoalError(f"openssl {args[0]} failed: {done.stderr.strip().splitlines()[-1:]}")
    for key in ("ca.key", "member.key"):
        (d / key).chmod(0o600)
    return {"cert": str(d / "member.pem"), "key": str(d / "member.key"), "ca": str(d / "ca.pem")}
