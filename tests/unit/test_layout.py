import pytest
import torch

from shoal.errors import InvalidArgument
from shoal.state.layout import ModelLayout, ShardPlan, TensorSpec


def model():
    return torch.nn.Sequential(torch.nn.Linear(7, 300), torch.nn.ReLU(), torch.nn.Linear(300, 3),
                               torch.nn.Linear(3, 1, bias=False))


@pytest.mark.parametrize("numel,shards", [(0, 1), (1, 3), (10, 3), (3313, 2), (3313, 7), (1 << 20, 4)])
def test_plan_is_byte_balanced_and_covers_everything(numel, shards):
    plan = ShardPlan(numel, shards)
    sizes = [b - a for a, b in plan.ranges]
    assert sum(sizes) == numel
    assert max(sizes) - min(sizes) <= 1
    assert plan.ranges[0][0] == 0 and plan.ranges[-1][1] == numel
    assert all(plan.ranges[k][1] == plan.ranges[k + 1][0] for k in range(shards - 1))


def test_large_tensor_is_split_and_small_ones_are_packed():
    layout = ModelLayout.from_module(model())
    plan = ShardPlan(layout.numel, 3)
    big = layout.specs.index(next(s for s in layout.specs if s.name == "0.weight"))
    segs = plan.segments(layout.offsets[big], layout.specs[big].numel)
    assert len({s.shard for s in segs}) >= 2                      # the 7x300 weight spans shards
    assert sum(s.length for s in segs) == layout.specs[big].numel
    last = len(layout.specs) - 1                                   # 3 floats, packed with others
    assert len(plan.segments(layout.offsets[last], layout.specs[last].numel)) == 1


def test_flatten_split_round_trip():
    m = model()
    layout = ModelLayout.from_module(m)
    params = [p.detach().clone() for p in m.parameters()]
    flat = layout.flatten(params)
    plan = ShardPlan(layout.numel, 4)
    rebuilt = torch.cat([s.clone() for s in plan.slices(flat)])
    for orig, back in zip(params, layout.unflatten(rebuilt)):
        assert torch.equal(orig, back)


def test_fingerprint_and_diff_name_what_differs():
    a = ModelLayout.from_module(model())
    b = ModelLayout.from_module(torch.nn.Sequential(torch.nn.Linear(7, 300), torch.nn.ReLU(),
                                                    torch.nn.Linear(300, 4), torch.nn.Linear(3, 1, bias=False)))
    assert a.fingerprint == ModelLayout.from_module(model()).fingerprint
    assert a.fingerprint != b.fingerprint
    diff = a.diff(b)
    assert "2.weight: expected [3, 300] float32, got [4, 300] float32" in diff
    assert "2.bias: expected [3] float32, got [4] float32" in diff
    assert len(diff) == 2


def test_unsupported_dtype_is_a_clear_error():
    with pytest.raises(InvalidArgument, match="float64"):
        TensorSpec("w", (2, 2), "float64")
    with pytest.raises(InvalidArgument, match="num_shards"):
        ShardPlan(10, 0)
