"""Handwritten digits (scikit-learn's 8x8 set) with an MLP, trained on a shoal cluster.

    shoal local --ps 2 --workers 2 --mode sync examples/digits.py --epochs 15

Only four lines differ from single-process training: build a ``Trainer``, take
batches from ``trainer.batches``, call ``trainer.step()`` instead of
``optimizer.step()``, and ``trainer.report`` the test accuracy.
"""
from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from shoal.worker import Trainer

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "shoal"


def load(seed: int):
    """The train/test split for ``seed``. Importing scikit-learn costs about a second of CPU, which a
    worker joining a running job spends while the others train, so the split is kept in a cache file
    after the first load and later workers read that instead."""
    path = CACHE / f"digits-split-{seed}.npz"
    try:
        with np.load(path) as f:
            xtr, xte, ytr, yte = (torch.from_numpy(f[k]) for k in ("xtr", "xte", "ytr", "yte"))
    except (OSError, KeyError, ValueError):
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        digits = load_digits()
        x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
        y = torch.tensor(digits.target, dtype=torch.long)
        xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
        try:
            CACHE.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp.npz")
            np.savez(tmp, xtr=xtr.numpy(), xte=xte.numpy(), ytr=ytr.numpy(), yte=yte.numpy())
            tmp.replace(path)                     # atomic: workers starting together may race here
        except OSError as exc:
            logging.debug("cannot cache the digits split in %s: %s", CACHE, exc)
    return (xtr, ytr), (xte, yte)


def build_model(hidden: int, depth: int = 1) -> torch.nn.Module:
    layers: list[torch.nn.Module] = [torch.nn.Linear(64, hidden), torch.nn.ReLU()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(hidden, 10))


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # a job file (shoal worker/local --config job.yaml) sets these defaults: its train and optimizer sections
    train, opt = Trainer.job_section("train"), Trainer.job_section("optimizer")
    p.add_argument("--epochs", type=int, default=train.get("epochs", 15))
    p.add_argument("--batch-size", type=int, default=train.get("batch_size", 32))
    p.add_argument("--optimizer", default=opt.get("name", "adam"), choices=("adam", "adamw", "sgd"))
    p.add_argument("--lr", type=float, default=opt.get("lr", 0.003))
    p.add_argument("--momentum", type=float, default=opt.get("momentum", 0.0), help="sgd only")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--depth", type=int, default=1, help="hidden layers")
    p.add_argument("--compression", default=None, help="gradient codec (default: $SHOAL_COMPRESSION or none)")
    p.add_argument("--momentum-correction", action=argparse.BooleanOptionalAction, default=True,
                   help="with top-k, the workers apply the momentum or Adam's moments before compressing")
    p.add_argument("--step-delay", type=float, default=0.0, help="seconds every worker sleeps per step")
    p.add_argument("--slow-worker", type=int, default=-1, help="index of a worker made slower (shoal local)")
    p.add_argument("--slow-delay", type=float, default=0.0, help="extra seconds per step for --slow-worker")
    p.add_argument("--time-budget", type=float, default=0.0, help="stop training after this many seconds")
    p.add_argument("--step-log", default="", help="append one wall-clock time per finished step to this file ({pid} is replaced)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.manual_seed(args.seed)
    (xtr, ytr), (xte, yte) = load(args.seed)

    delay = args.step_delay
    if args.slow_worker >= 0 and os.environ.get("SHOAL_LOCAL_INDEX") == str(args.slow_worker):
        delay += args.slow_delay
    step_log = open(args.step_log.format(pid=os.getpid()), "a", buffering=1) if args.step_log else None
    started = time.monotonic()

    model = build_model(args.hidden, args.depth)
    if step_log:
        step_log.write(f"# trainer {time.time():.6f}\n")   # when this worker starts joining
    hparams = {"momentum": args.momentum} if args.optimizer == "sgd" else {}
    trainer = Trainer(model, optimizer=args.optimizer, lr=args.lr, compression=args.compression,
                      momentum_correction=args.momentum_correction, **hparams)
    for step, (xb, yb) in enumerate(trainer.batches((xtr, ytr), batch_size=args.batch_size,
                                                     epochs=args.epochs, seed=args.seed)):
        trainer.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        if delay:
            time.sleep(delay)
        trainer.step(samples=len(xb), loss=loss)
        if step_log:
            step_log.write(f"{time.time():.6f}\n")
        if step % 50 == 0:
            logging.info("step %d loss %.4f", step, loss.item())
        if args.time_budget and time.monotonic() - started > args.time_budget:
            logging.info("time budget of %.1fs spent after %d steps", args.time_budget, step + 1)
            break
    trainer.pull()
    acc = accuracy(model, xte, yte)
    logging.info("test accuracy %.4f after %d local steps", acc, trainer.step_count)
    trainer.report(test_accuracy=acc)
    trainer.close()


if __name__ == "__main__":
    main()
