"""``--security none|token|tls`` for the benchmarks: the environment every process of a case inherits
(a job token; with ``tls``, mutual TLS as well, with a throw-away CA)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from shoal.security import auth, tls
from shoal.cli.certs import make_local_pki

MODES = ("none", "token", "tls")
_ENV = (auth.TOKEN_ENV, *tls.ENV.values())


def use(mode: str) -> None:
    """Sets this process's (and its children's) security to ``mode``."""
    for name in _ENV:
        os.environ.pop(name, None)
    if mode != "none":
        d = Path(tempfile.mkdtemp(prefix="shoal-bench-sec-"))
        os.environ[auth.TOKEN_ENV] = str(auth.write_token_file(d / "job.token"))
        if mode == "tls":
            for name, path in make_local_pki(d / "tls").items():
                os.environ[tls.ENV[name]] = path
            os.environ[tls.ENV["mutual"]] = "1"
    auth.reset()
    tls.reset()
