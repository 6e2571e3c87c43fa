"""The commands: ``shoal chief|ps|worker|local|status|export``.

This floor sits above the roles: it may import any of them (lazily, inside the
command that needs it, to keep start-up fast); nothing below imports it.
"""
from shoal.cli.main import main

__all__ = ["main"]
