"""Where a shard's gradients leave from and its pulled weights land: memory a socket can use.

On the CPU that is the flat buffers themselves: nothing is copied. On CUDA each
shard gets page-locked (pinned) host buffers. A raw fp32 push copies the
shard's gradients device-to-host on a side stream, after an event recorded
when backward produced them, and sends from the pinned buffer; a pull lands
in the pinned buffer and is copied host-to-device on the side stream, and the
next forward waits for that copy on the GPU, not on the host. Codecs other
than ``none`` compress on the GPU first (their math runs on the input's
device), so only the compact payload crosses to the host.
"""
from __future__ import annotations

import threading

import torch


class Staging:
    """Host-side views of ``weights`` and ``grads`` (flat fp32, same device) for each shard range."""

    def __init__(self, weights: torch.Tensor, grads: torch.Tensor, ranges: list[tuple[int, int]]):
        self.weights, self.grads, self.ranges = weights, grads, ranges
        self.cuda = weights.device.type == "cuda"
        if self.cuda:
            self._host_grads = torch.empty(weights.numel(), dtype=torch.float32, pin_memory=True)
            self._host_weights = torch.empty(weights.numel(), dtype=torch.float32, pin_memory=True)
            self._stream = torch.cuda.Stream(device=weights.device)
            self._lock = threading.Lock()       # streams are shared by the shard threads
            self._landed: dict[int, torch.cuda.Event] = {}

    def grads_ready(self) -> "torch.cuda.Event | None":
        """Marks the point on the calling thread's current stream where the gradients are complete."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.grads.device))
        return event

    def host_grads(self, shard: int, ready: "torch.cuda.Event | None") -> torch.Tensor:
        """The shard's gradients in host memory (a CPU view, or a pinned copy once ``ready`` has passed)."""
        a, b = self.ranges[shard]
        if not self.cuda:
            return self.grads[a:b]
        with self._lock:
            with torch.cuda.stream(self._stream):
                if ready is not None:
                    self._stream.wait_event(ready)
                else:
                    self._stream.wait_stream(torch.cuda.current_stream(self.grads.device))
                self._host_grads[a:b].copy_(self.grads[a:b], non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._stream)
        done.synchronize()
        return self._host_grads[a:b]

    def weights_target(self, shard: int) -> torch.Tensor:
        """Where the shard's pulled weights are written: the weights themselves, or a pinned buffer."""
        a, b = self.ranges[shard]
        if not self.cuda:
            return self.weights[a:b]
        landed = self._landed.pop(shard, None)
        if landed is not None:
            landed.synchronize()       # the last copy out of this buffer must be done before it is refilled
        return self._host_weights[a:b]

    def land(self, shard: int) -> None:
        """Starts moving a pulled shard to the device (no-op on the CPU)."""
        if not self.cuda:
            return
        a, b = self.ranges[shard]
        with self._lock, torch.cuda.stream(self._stream):
            self.weights[a:b].copy_(self._host_weights[a:b], non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(self._stream)
        self._landed[shard] = landed

    def before_compute(self) -> None:
        """Work queued on the device from now on sees every landed weight (the host does not wait)."""
        if self.cuda:
            torch.cuda.current_stream(self.weights.device).wait_stream(self._stream)
