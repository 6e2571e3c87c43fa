"""A griffe extension (mkdocs.yml, mkdocstrings' python handler): Sphinx roles in shoal's docstrings as code.

The docstrings are written for ``help()`` and Sphinx: ``:class:`~shoal.worker.Trainer``` would reach the
site as the raw role. This turns each role into a code span of the name it shows (``Trainer``).
"""
from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):`(~?)([^`]+)`")


def plain_roles(text: str) -> str:
    """``:class:`~a.b.C``` -> ```C```; ``:mod:`a.b``` -> ```a.b```."""
    return _ROLE.sub(lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", text)


class SphinxRoles(griffe.Extension):
    """Rewrites every docstring griffe loads, once, before mkdocstrings renders it."""

    def on_object(self, *, obj: griffe.Object, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        if obj.docstring:
            obj.docstring.value = plain_roles(obj.docstring.value)
