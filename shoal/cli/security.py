"""Flags every role shares for who may talk to it: ``--token-file`` (and where it listens)."""
from __future__ import annotations

import argparse
import ipaddress
import logging
import os

from shoal import auth

log = logging.getLogger("shoal")


def add_token_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token-file", default=None,
                   help=f"file holding the job token every role must present (default ${auth.TOKEN_ENV}; "
                        f"none: no authentication, for loopback-only jobs)")


def apply(args: argparse.Namespace) -> None:
    """Reads the job token once (a bad file is the command's one-line error) and hands its path on
    to the processes this one starts (the training script, ``shoal local``'s roles)."""
    path = auth.token_path(getattr(args, "token_file", None))
    if path:
        os.environ[auth.TOKEN_ENV] = os.path.abspath(path)
    auth.reset()
    auth.job_token()


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
    if is_loopback(bind):
        return
    if auth.job_token() is None:
        log.warning("%s listens on %s without TLS or a job token: anyone who reaches it can join the job, "
                    "push gradients and stop it; give every role --token-file (see SECURITY.md)", role, bind)
    else:
        log.warning("%s listens on %s without TLS: the job token and the model travel in plaintext "
                    "(see SECURITY.md)", role, bind)
