"""The model's buffers (BatchNorm running statistics, ...) as part of the job's state.

Buffers sit after the parameters in the flat vector the shards hold, as fp32
(an integer buffer such as ``num_batches_tracked`` is stored as a float and
rounded back). They are never stepped by the optimizer. Like DDP's
``broadcast_buffers`` they are kept the same on every worker, but they are not
simply the chief worker's: every push carries, for each buffer element, how far
this worker's forward passes moved it since its last pull, and the shard adds
that change (averaged over a sync round, applied on arrival in async). In sync
mode the job's running mean is then the average of the workers' running means,
a step at a time; in async each worker's batches move the statistics in turn,
as one process's would. After every pull the worker's buffers are the job's,
so evaluation, checkpoints and ``shoal export`` (``load_state_dict(...,
strict=True)``) all see the same statistics, and a worker that joins or restarts
starts from them.
"""
from __future__ import annotations

import torch

from shoal.state.layout import TensorSpec


class ModelBuffers:
    """The module's buffers, placed at ``start`` (after the parameters) in the flat vector."""

    def __init__(self, model: torch.nn.Module, start: int):
        self.start = start
        self.items: list[tuple[str, torch.Tensor, int]] = []
        off = start
        for name, buf in model.named_buffers():
            if buf is None or buf.is_complex():
                continue
            self.items.append((name, buf, off))
            off += buf.numel()
        self.numel = off - start
        self._base: torch.Tensor | None = None      # the buffers as last pulled

    @property
    def specs(self) -> list[TensorSpec]:
        return [TensorSpec(name, tuple(buf.shape)) for name, buf, _ in self.items]

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        return ((self.start, self.start + self.numel),) if self.numel else ()

    def write(self, flat: torch.Tensor) -> None:
        """Copies the buffers' current values into ``flat`` (at start-up, before a shard is initialised)."""
        for _, buf, off in self.items:
            flat[off:off + buf.numel()].copy_(buf.detach().reshape(-1))

    def load(self, flat: torch.Tensor) -> None:
        """The job's buffers, just pulled into ``flat``, become the module's."""
        if not self.items:
            return
        for _, buf, off in self.items:
            src = flat[off:off + buf.numel()].view(buf.shape)
            buf.copy_(src.round() if not buf.is_floating_point() else src)
        self._base = flat[self.start:self.start + self.numel].clone()

    def fill_deltas(self, grads: torch.Tensor) -> None:
        """Writes into ``grads`` how far each buffer moved since the last :meth:`load`."""
        if self._base is None:
            return
        for _, buf, off in self.items:
            n = buf.numel()
            g = grads[off:off + n]
            g.copy_(buf.detach().reshape(-1))
            g.sub_(self._base[off - self.start:off - self.start + n])

    def patch(self, out: torch.Tensor, shard_start: int, grads: torch.Tensor) -> None:
        """Puts the raw deltas back into ``out`` (a shard's slice being sent, starting at ``shard_start``),
        where a worker-side momentum would have mixed them into its velocity."""
        a, b = max(self.start, shard_start), min(self.start + self.numel, shard_start + out.numel())
        if a < b:
            out[a - shard_start:b - shard_start].copy_(grads[a:b])
