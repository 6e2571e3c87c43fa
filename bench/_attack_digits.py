"""The digits example with one attacking worker (bench/update_attacks.py): the worker ``shoal local``
numbers ``--attacker`` pushes, from its own client, a finite gradient of 3e38 at step ``--norm-step``
and a learning rate of 1e30 at step ``--lr-step``; every other step, and every other worker, is honest."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from digits import accuracy, build_model, load  # noqa: E402

from shoal.worker import Trainer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.003)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attacker", type=int, default=1)
    p.add_argument("--norm-step", type=int, default=5)
    p.add_argument("--lr-step", type=int, default=10)
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.manual_seed(args.seed)
    (xtr, ytr), (xte, yte) = load(args.seed)
    evil = os.environ.get("SHOAL_LOCAL_INDEX") == str(args.attacker)
    model = build_model(256)
    lr_attack = [False]
    trainer = Trainer(model, optimizer="adam", lr=args.lr,
                      hparams_source=lambda: {"0.lr": 1e30} if lr_attack[0] else {})
    for step, (xb, yb) in enumerate(trainer.batches((xtr, ytr), batch_size=args.batch_size, epochs=args.epochs,
                                                     seed=args.seed)):
        trainer.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        if evil and step == args.norm_step:
            next(model.parameters()).grad.view(-1)[0] = 3e38
            logging.info("attacking: a gradient of 3e38")
        lr_attack[0] = evil and step == args.lr_step
        if lr_attack[0]:
            logging.info("attacking: a learning rate of 1e30")
        trainer.step(samples=len(xb), loss=loss)
    trainer.pull()
    acc = accuracy(model, xte, yte)
    logging.info("test accuracy %.4f after %d local steps", acc, trainer.step_count)
    trainer.report(test_accuracy=acc)
    trainer.close()


if __name__ == "__main__":
    main()
