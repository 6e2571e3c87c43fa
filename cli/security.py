"""Flags every role shares for who may talk to it: ``--token-file``, ``--tls-*`` (and where it listens)."""
from __future__ import annotations

import argparse
import ipaddress
import logging
import os

from shoal.security import auth, tls

log = logging.getLogger("shoal")


def add_token_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token-file", default=None,
                   help=f"file holding the job token every role must present (default ${auth.TOKEN_ENV}; "
                        f"none: no authentication, for loopback-only jobs)")
    p.add_argument("--tls-cert", default=None, help=f"PEM certificate this role serves with (${tls.ENV['cert']})")
    p.add_argument("--tls-key", default=None, help=f"PEM private key of --tls-cert (${tls.ENV['key']})")
    p.add_argument("--tls-ca", default=None,
                   help=f"PEM CA certificate(s) servers are checked against (${tls.ENV['ca']}); any --tls-* "
                        f"setting makes every connection TLS")
    p.add_argument("--tls-mutual", action="store_true", default=None,
                   help=f"servers require client certificates signed by --tls-ca (${tls.ENV['mutual']}=1)")


def apply(args: argparse.Namespace) -> None:
    """Reads the job token once (a bad file is the command's one-line error) and hands its path on
    to the processes this one starts (the training script, ``shoal local``'s roles)."""
    path = auth.token_path(getattr(args, "token_file", None))
    if path:
        os.environ[auth.TOKEN_ENV] = os.path.abspath(path)
    for name in ("cert", "key", "ca"):
        value = getattr(args, f"tls_{name}", None)
        if value:
            os.environ[tls.ENV[name]] = os.path.abspath(value)
    if getattr(args, "tls_mutual", None):
        os.environ[tls.ENV["mutual"]] = "1"
    auth.reset()
    auth.job_token()
    tls.reset()
    tls.context("server")     # loads the PEM files now: a bad one is this command's one-line error
    tls.context("client")


def is_loopback(bind: str) -> bool:
    host = bind.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def warn_if_exposed(role: str, bind: str) -> None:
    """One warning at start for a role listening beyond this host without TLS."""
    if is_loopback(bind) or tls.config().serves:
        return
    if auth.job_token() is None:
        log.warning("%s listens on %s without TLS or a job token: anyone who reaches it can join the job, "
                    "push gradients and stop it; give every role --token-file (see SECURITY.md)", role, bind)
    else:
        log.warning("%s listens on %s without TLS: the job token and the model travel in plaintext "
                    "(see SECURITY.md)", role, bind)
