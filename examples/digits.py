"""Handwritten digits (scikit-learn's 8x8 set) with an MLP, trained on a shoal cluster.

    shoal local --ps 2 --workers 2 --mode sync examples/digits.py --epochs 15

Only four lines differ from single-process training: build a ``Trainer``, take
batches from ``trainer.batches``, call ``trainer.step()`` instead of
``optimizer.step()``, and ``trainer.report`` the test accuracy.
"""
from __future__ import annotations

import argparse
import logging
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from shoal.worker import Trainer


def load(seed: int):
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    return (xtr, ytr), (xte, yte)


def build_model(hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.003)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep per step (a slow worker)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.manual_seed(args.seed)
    (xtr, ytr), (xte, yte) = load(args.seed)

    model = build_model(args.hidden)
    trainer = Trainer(model, optimizer="adam", lr=args.lr)
    for step, (xb, yb) in enumerate(trainer.batches((xtr, ytr), batch_size=args.batch_size,
                                                     epochs=args.epochs, seed=args.seed)):
        trainer.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        trainer.step(samples=len(xb))
        if step % 50 == 0:
            logging.info("step %d loss %.4f", step, loss.item())
        if args.step_delay:
            time.sleep(args.step_delay)
    trainer.pull()
    acc = accuracy(model, xte, yte)
    logging.info("test accuracy %.4f after %d local steps", acc, trainer.step_count)
    trainer.report(test_accuracy=acc)
    trainer.close()


if __name__ == "__main__":
    main()
