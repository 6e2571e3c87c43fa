"""Host staging of gradients and weights: views on the CPU, pinned copies on CUDA."""
import pytest
import torch

from shoal.worker.staging import Staging

RANGES = [(0, 5), (5, 12)]


def test_on_the_cpu_the_flat_buffers_are_used_as_they_are():
    w, g = torch.arange(12.0), torch.ones(12)
    s = Staging(w, g, RANGES)
    assert not s.cuda and s.grads_ready() is None
    assert s.host_grads(1, None).data_ptr() == g[5:].data_ptr()
    target = s.weights_target(0)
    assert target.data_ptr() == w.data_ptr()
    target.fill_(7.0)                          # a pull writes the model's weights directly
    s.land(0)
    s.before_compute()
    assert w[:5].tolist() == [7.0] * 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_gradients_leave_and_weights_land_through_pinned_buffers():
    w, g = torch.zeros(12, device="cuda"), torch.arange(12.0, device="cuda")
    s = Staging(w, g, RANGES)
    g.mul_(2)                                  # queued work the copy must wait for
    host = s.host_grads(1, s.grads_ready())
    assert host.device.type == "cpu" and host.is_pinned() and host.tolist() == [2.0 * i for i in range(5, 12)]
    for shard, (a, b) in enumerate(RANGES):
        s.weights_target(shard).copy_(torch.arange(a, b, dtype=torch.float32))
        s.land(shard)
    s.weights_target(0).fill_(-1)              # waits for shard 0's copy before the buffer is reused
    s.before_compute()
    torch.cuda.synchronize()
    assert w.tolist() == [float(i) for i in range(12)]
