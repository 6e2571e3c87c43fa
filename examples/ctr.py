"""A DLRM-style click-through model on synthetic Criteo-like data, trained with plain PyTorch.

    .venv/bin/python examples/ctr.py --rows 1048576 --steps 3000              # one process
    shoal local --ps 2 --workers 2 --mode sync examples/ctr.py --steps 3000   # on a cluster

The data come from a planted model (examples/ctr_data.py), so the best AUC any model can reach on the
test split is known: the script prints the test AUC (scikit-learn's ``roc_auc_score``) next to that
Bayes AUC. The model is DLRM's shape (Naumov et al., 2019): one embedding table (``nn.EmbeddingBag``,
``sparse=True``) shared by the 26 categorical features, each feature's ids at its own offset; a bottom
MLP for the 13 dense features; the pairwise dot products of the 27 vectors; a top MLP to one logit.
The table's gradients are sparse (the rows the batch touched), so its optimizer must take sparse
gradients: ``--optimizer adagrad`` (one ``torch.optim.Adagrad`` for every parameter) or ``adam``
(``torch.optim.SparseAdam`` for the table, ``torch.optim.Adam`` for the rest).

On a cluster (``$SHOAL_CHIEF`` set, as ``shoal local`` and ``shoal worker`` do), the lines marked
``# shoal`` differ: the table is built on the ``meta`` device (never allocated on a worker; its rows
live on the parameter servers), the optimizer is wrapped by ``DistributedOptimizer``, and the
DataLoader takes the chief's tasks through ``DistributedSampler``.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ctr_data import NUM_DENSE, NUM_SPARSE, CTRConfig, CTRDataset, collate  # noqa: E402

ON_CLUSTER = bool(os.environ.get("SHOAL_CHIEF"))                    # shoal: set by shoal local / shoal worker


def mlp(sizes: list[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2 or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    """Bottom MLP (dense features -> ``dim``), one shared ``rows`` x ``dim`` table for the 26 sparse
    features, dot interaction of the 27 vectors, top MLP -> one logit."""

    def __init__(self, rows: int, dim: int = 16, bottom: tuple[int, ...] = (64,), top: tuple[int, ...] = (128, 64),
                 init_std: float = 0.05, table_device: str | torch.device | None = None):
        super().__init__()
        self.dim = dim
        self.bottom = mlp([NUM_DENSE, *bottom, dim], last_relu=True)
        self.table = nn.EmbeddingBag(rows, dim, mode="sum", sparse=True, device=table_device)
        nn.init.normal_(self.table.weight, 0.0, init_std)
        if self.table.weight.is_meta:                               # shoal: the servers initialise the rows
            from shoal.worker.embedding import table_options
            table_options(self.table, init_std=init_std)
        n = NUM_SPARSE + 1
        self.pairs = torch.triu_indices(n, n, offset=1)                 # a constant: not the model's state
        self.top = mlp([dim + self.pairs.shape[1], *top, 1], last_relu=False)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        b = ids.shape[0]
        x = self.bottom(dense)                                          # (B, dim)
        e = self.table(ids.reshape(-1, 1)).view(b, NUM_SPARSE, self.dim)   # bags of one id: (B, 26, dim)
        z = torch.cat([x[:, None, :], e], dim=1)                        # (B, 27, dim)
        dots = torch.bmm(z, z.transpose(1, 2))[:, self.pairs[0], self.pairs[1]]   # (B, 351)
        return self.top(torch.cat([x, dots], dim=1)).squeeze(1)


def optimizers(model: DLRM, name: str, lr: float, table_lr: float) -> list[torch.optim.Optimizer]:
    """``adagrad``: one Adagrad, the table in a group of its own; ``adam``: SparseAdam for the table (first:
    on a cluster its DistributedOptimizer must be made before the dense one's), Adam for the rest."""
    dense = [p for n, p in model.named_parameters() if not n.startswith("table.")]
    if name == "adagrad":
        return [torch.optim.Adagrad([{"params": [model.table.weight], "lr": table_lr}, {"params": dense}], lr=lr)]
    return [torch.optim.SparseAdam([model.table.weight], lr=table_lr), torch.optim.Adam(dense, lr=lr)]


def evaluate(model: nn.Module, test: CTRDataset, batch_size: int = 8192) -> float:
    """The model's test AUC (scikit-learn's roc_auc_score of its P(click) against the test clicks)."""
    from sklearn.metrics import roc_auc_score

    model.eval()
    scores, clicks = [], []
    with torch.no_grad():
        for dense, ids, y in test.batches(batch_size):
            scores.append(torch.sigmoid(model(dense, ids)).numpy())
            clicks.append(y.numpy())
    model.train()
    return float(roc_auc_score(np.concatenate(clicks), np.concatenate(scores)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2 ** 20, help="rows of the shared table (all 26 features)")
    p.add_argument("--dim", type=int, default=16, help="embedding dimension")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--steps", type=int, default=3000, help="stop after this many steps (0: run every epoch)")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--train-samples", type=int, default=4_000_000)
    p.add_argument("--test-samples", type=int, default=100_000)
    p.add_argument("--optimizer", default="adagrad", choices=("adagrad", "adam"))
    p.add_argument("--lr", type=float, default=0.01, help="learning rate of the dense part")
    p.add_argument("--table-lr", type=float, default=0.05, help="learning rate of the table")
    p.add_argument("--init-std", type=float, default=0.05, help="the table's rows start as N(0, init_std^2)")
    p.add_argument("--zipf", type=float, default=1.05, help="exponent of the ids' Zipf law")
    p.add_argument("--seed", type=int, default=0, help="seed of the data (planted model) and the model")
    p.add_argument("--loader-workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--log-every", type=int, default=500)
    p.add_argument("--threads", type=int, default=1,
                   help="torch's intra-op threads (the model is small: more only help on idle cores)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    # the sparse optimizers build their coordinate tensors from indices they made themselves: say so, as
    # torch asks, rather than have it warn at the first step
    torch.sparse.check_sparse_tensor_invariants.disable()

    cfg = CTRConfig(rows=args.rows, seed=args.seed, zipf=args.zipf)
    train = CTRDataset(cfg, "train", args.train_samples)
    test = CTRDataset(cfg, "test", args.test_samples)

    table_device = "meta" if ON_CLUSTER else None                   # shoal: the table is never on a worker
    model = DLRM(args.rows, args.dim, init_std=args.init_std, table_device=table_device)
    opts = optimizers(model, args.optimizer, args.lr, args.table_lr)
    sampler = None
    if ON_CLUSTER:                                                  # shoal: wrap the optimizer, take the tasks
        from shoal.worker import DistributedOptimizer, DistributedSampler
        opts = [DistributedOptimizer(opt, model) for opt in opts]
        sampler = DistributedSampler(train, batch_size=args.batch_size, epochs=args.epochs, seed=args.seed)
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=sampler is None, sampler=sampler,
                        collate_fn=collate, num_workers=args.loader_workers)

    step, started = 0, time.perf_counter()
    for epoch in range(args.epochs):
        for dense, ids, clicks in loader:
            for opt in opts:
                opt.zero_grad()
            loss = F.binary_cross_entropy_with_logits(model(dense, ids), clicks)
            loss.backward()
            for opt in opts:
                opt.step()
            step += 1
            if step % args.log_every == 0:
                logging.info("epoch %d step %d loss %.4f (%.0f samples/s)", epoch, step, loss.item(),
                             step * args.batch_size / (time.perf_counter() - started))
            if step == args.steps:
                break
        if step == args.steps:
            break
    seconds = time.perf_counter() - started
    if ON_CLUSTER:                                                  # shoal: the job's newest weights
        opts[0].synchronize()

    auc = evaluate(model, test)
    bayes = test.bayes_auc()
    logging.info("test AUC %.4f after %d steps of %d (%.1f s); Bayes AUC (the planted model's) %.4f; gap %.4f",
                 auc, step, args.batch_size, seconds, bayes, bayes - auc)
    print(f"test_auc={auc:.4f} bayes_auc={bayes:.4f} steps={step} batch_size={args.batch_size} rows={args.rows}",
          flush=True)
    if ON_CLUSTER:                                                  # shoal: into the run summary
        opts[0].report(test_auc=auc, bayes_auc=bayes)


if __name__ == "__main__":
    main()
