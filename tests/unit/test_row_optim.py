"""Row optimizers of the server-side tables against PyTorch on ``nn.Embedding(sparse=True)``, and FTRL against
the paper's per-coordinate algorithm (McMahan et al. 2013, Algorithm 1) written out here in float64."""
import math

import numpy as np
import pytest
import torch

from shoal.errors import InvalidArgument
from shoal.ps.tables import ROW_OPTIMIZERS, RowTable, TableSpec, row_optimizer

N, DIM, STEPS = 40, 6, 12


def batches(seed: int):
    """Ids with repeats inside a batch (torch sums them), ids seen before and fresh ones each step."""
    rng = np.random.default_rng(seed)
    for step in range(STEPS):
        seen = rng.integers(0, 10, 8)                       # a hot set, touched again and again
        fresh = rng.integers(10 + 2 * step, 12 + 2 * step, 3)  # new rows each step
        ids = np.concatenate([seen, fresh, seen[:3]])       # repeats
        target = rng.standard_normal((ids.size, DIM)).astype(np.float32)
        yield step, ids, target


def run_torch_and_table(opt_name: str, make_torch_opt, hyper: dict, seed: int = 0):
    spec = TableSpec("emb", DIM, N, opt_name, hyper, init_std=0.5, seed=7)
    table = RowTable(spec, 0, 1)
    ids0, init = table.export()
    assert (ids0 == np.arange(N)).all()
    emb = torch.nn.Embedding(N, DIM, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(init))
    opt = make_torch_opt(emb.parameters())
    for step, ids, target in batches(seed):
        opt.zero_grad()
        out = emb(torch.from_numpy(ids))
        loss = ((out - torch.from_numpy(target)) ** 2).sum() * 0.5
        loss.backward()
        g = emb.weight.grad.coalesce()
        uid = g.indices()[0].numpy().astype(np.int64)
        gv = g.values().numpy().astype(np.float32)
        with torch.sparse.check_sparse_tensor_invariants():     # opt in, as torch asks (else it warns)
            opt.step()
        table.apply(uid, gv, step)
        yield step, emb, opt, table, uid


@pytest.mark.parametrize("name,make,hyper", [
    ("sgd", lambda p: torch.optim.SGD(p, lr=0.07), {"lr": 0.07}),
    ("adagrad", lambda p: torch.optim.Adagrad(p, lr=0.3, initial_accumulator_value=0.1, eps=1e-10),
     {"lr": 0.3, "initial_accumulator_value": 0.1, "eps": 1e-10}),
    ("adagrad", lambda p: torch.optim.Adagrad(p, lr=0.3, lr_decay=0.05),
     {"lr": 0.3, "lr_decay": 0.05}),
    ("adam", lambda p: torch.optim.SparseAdam(p, lr=0.05, betas=(0.8, 0.99), eps=1e-6),
     {"lr": 0.05, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6}),
    ("adam", lambda p: torch.optim.SparseAdam(p), {}),
])
def test_matches_torch_step_by_step(name, make, hyper):
    touched = set()
    for step, emb, opt, table, uid in run_torch_and_table(name, make, hyper):
        touched.update(uid.tolist())
        w = emb.weight.detach().numpy()
        np.testing.assert_allclose(table.lookup(np.arange(N)), w, rtol=2e-6, atol=2e-7,
                                   err_msg=f"{name} step {step}")
        if name == "adagrad":
            snap = table.snapshot(None)
            np.testing.assert_allclose(snap.state["sum"], opt.state[emb.weight]["sum"].numpy()[snap.ids], rtol=1e-6)
        if name == "adam":
            snap = table.snapshot(None)
            st = opt.state[emb.weight]
            assert table.step_count == int(st["step"])
            np.testing.assert_allclose(snap.state["exp_avg"], st["exp_avg"].numpy()[snap.ids], rtol=1e-5, atol=1e-8)
            np.testing.assert_allclose(snap.state["exp_avg_sq"], st["exp_avg_sq"].numpy()[snap.ids],
                                       rtol=1e-5, atol=1e-10)
    # only touched rows are stored, each with its update count
    assert table.rows == len(touched)
    assert set(table.snapshot(None).ids.tolist()) == touched


def ftrl_reference(w0, grads_per_step, alpha, beta, l1, l2, n0):
    """McMahan et al. 2013, Algorithm 1, per coordinate, float64; w starts at the row's initial value."""
    w = {k: [float(x) for x in v] for k, v in w0.items()}
    z = {k: [0.0] * len(v) for k, v in w0.items()}
    n = {k: [n0] * len(v) for k, v in w0.items()}
    for grads in grads_per_step:
        for i, g_row in grads.items():
            for c, g in enumerate(g_row):
                g = float(g)
                sigma = (math.sqrt(n[i][c] + g * g) - math.sqrt(n[i][c])) / alpha
                z[i][c] += g - sigma * w[i][c]
                n[i][c] += g * g
                if abs(z[i][c]) <= l1:
                    w[i][c] = 0.0
                else:
                    sgn = 1.0 if z[i][c] > 0 else -1.0
                    w[i][c] = -(z[i][c] - sgn * l1) / ((beta + math.sqrt(n[i][c])) / alpha + l2)
    return w, z, n


@pytest.mark.parametrize("hyper,init_std", [
    ({"alpha": 0.1, "beta": 1.0, "l1": 0.5, "l2": 0.1}, 0.0),          # sparsity from l1: some weights exactly 0
    ({"alpha": 0.3, "beta": 0.5, "l1": 0.0, "l2": 1.0, "initial_accumulator_value": 0.2}, 0.3),
])
def test_ftrl_matches_the_papers_per_coordinate_algorithm(hyper, init_std):
    spec = TableSpec("ctr", 4, None, "ftrl", hyper, init_std=init_std, seed=3)
    table = RowTable(spec, 0, 1)
    rng = np.random.default_rng(1)
    all_ids = np.array([-5, 3, 2**40, 17, 99], np.int64)
    w0 = {int(i): table.lookup(np.array([i]))[0] for i in all_ids}
    steps = []
    for step in range(15):
        ids = np.unique(rng.choice(all_ids, size=3))
        g = (rng.standard_normal((ids.size, 4)) * 2).astype(np.float32)
        table.apply(ids, g, step)
        steps.append({int(i): g[k] for k, i in enumerate(ids)})
    h = spec.resolved_hyper()
    w, z, n = ftrl_reference(w0, steps, h["alpha"], h["beta"], h["l1"], h["l2"], h["initial_accumulator_value"])
    got = table.lookup(all_ids)
    for k, i in enumerate(all_ids):
        np.testing.assert_allclose(got[k], w[int(i)], rtol=1e-4, atol=1e-6, err_msg=f"id {i}")
    snap = table.snapshot(None)
    for k, i in enumerate(snap.ids):
        np.testing.assert_allclose(snap.state["z"][k], z[int(i)], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(snap.state["n"][k], n[int(i)], rtol=1e-5)
    if hyper["l1"] > 0:
        assert (got == 0).any()         # l1 zeroes coordinates whose |z| <= l1, exactly


def test_registry_lists_known_names_and_checks_hyper():
    assert sorted(ROW_OPTIMIZERS) == ["adagrad", "adam", "ftrl", "sgd"]
    with pytest.raises(InvalidArgument, match=r"unknown row optimizer 'rmsprop'; known: \['adagrad', 'adam'"):
        row_optimizer("rmsprop")
    with pytest.raises(InvalidArgument, match=r"unknown adam hyper-parameter\(s\) \['momentum'\]"):
        TableSpec("t", 2, None, "adam", {"momentum": 0.9})
    with pytest.raises(InvalidArgument, match=r"adam beta1 must be finite in \[0.0, 1.0\), got 1.0"):
        TableSpec("t", 2, None, "adam", {"beta1": 1.0})
    with pytest.raises(InvalidArgument, match=r"ftrl alpha must be finite in \(0.0, inf\), got 0.0"):
        TableSpec("t", 2, None, "ftrl", {"alpha": 0})
    with pytest.raises(InvalidArgument, match=r"sgd lr must be finite .* got nan"):
        TableSpec("t", 2, None, "sgd", {"lr": float("nan")})


def test_per_apply_hyper_override_is_checked_and_used():
    spec = TableSpec("t", 2, None, "sgd", {"lr": 0.1}, init_std=0.0)
    table = RowTable(spec, 0, 1)
    table.apply(np.array([1]), np.ones((1, 2), np.float32), 0, hyper={"lr": 0.5})
    np.testing.assert_allclose(table.lookup(np.array([1])), [[-0.5, -0.5]])
    with pytest.raises(InvalidArgument, match="sgd lr must be finite"):
        table.apply(np.array([1]), np.ones((1, 2), np.float32), 1, hyper={"lr": -1.0})
    np.testing.assert_allclose(table.lookup(np.array([1])), [[-0.5, -0.5]])
