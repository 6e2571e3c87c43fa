"""Error feedback: what a biased codec dropped is added to the next gradient.

For each key (e.g. a ``(shard, offset)`` block id) :class:`ErrorFeedback`
keeps a residual ``r`` on the gradient's device and sends ``c = g + r``; after
encoding, ``r = c - decode(encode(c))``. Summed over steps, the decoded
gradients then equal the true ones minus the final residual, which stays
bounded, instead of losing the dropped part for good.
"""
from __future__ import annotations

import logging
from collections.abc import Hashable

import torch

from .base import Codec, check_input

log = logging.getLogger(__name__)


class ErrorFeedback:
    """Per-key residuals around ``codec``; unbiased codecs pass straight through.

    Not safe for concurrent calls with the same key (different keys are fine).
    """

    def __init__(self, codec: Codec):
        self.codec = codec
        self._residuals: dict[Hashable, torch.Tensor] = {}

    def encode(self, key: Hashable, grad: torch.Tensor) -> bytes:
        """The payload for ``grad`` plus ``key``'s residual; updates the residual."""
        if not self.codec.biased:
            return self.codec.encode(grad)
        grad = check_input(grad)
        residual = self._residuals.get(key)
        if residual is not None and residual.shape != grad.shape:
            log.warning("error feedback for %r: gradient of %d elements after %d, dropping the residual",
                        key, grad.numel(), residual.numel())
            residual = None
        # the new residual is new storage: on a failure the old one is kept as it was
        payload, self._residuals[key] = self.codec.encode_feedback(grad, residual)
        return payload

    def residual(self, key: Hashable) -> torch.Tensor | None:
        """``key``'s current residual (what has not been sent yet), or None."""
        return self._residuals.get(key)

    def discard(self, key: Hashable) -> None:
        """Forgets ``key``'s residual (e.g. after its block moved elsewhere)."""
        self._residuals.pop(key, None)

    def reset(self) -> None:
        """Forgets every residual."""
        self._residuals.clear()

    def __len__(self) -> int:
        return len(self._residuals)
