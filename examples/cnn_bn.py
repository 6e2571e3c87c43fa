"""A small CNN with BatchNorm on scikit-learn's 8x8 digits: a plain PyTorch loop, one line for shoal.

    python examples/cnn_bn.py                                          # one process
    shoal local --ps 2 --workers 2 --mode sync examples/cnn_bn.py     # a cluster: the same script

The script keeps its DataLoader (shuffle, workers), its optimizer, its LR
scheduler, its epoch loop and its evaluation after every epoch. Under shoal
(``$SHOAL_CHIEF`` is set by ``shoal worker`` / ``shoal local``) one line makes the
model, optimizer and DataLoader the job's (``shoal.worker.distribute``: in one process it
returns them unchanged), and the end pulls the job's weights and reports the accuracy;
these lines are marked ``# shoal``. ``--device cuda`` trains on the GPU (the DataLoader pins its
batches); ``--amp`` runs the forward pass under autocast: fp16 with a
``GradScaler`` on CUDA, bf16 on the CPU. ``--accumulate K`` steps the optimizer
once every K micro-batches (the loss divided by K), as plain PyTorch does.
"""
from __future__ import annotations

import argparse
import logging
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from digits import load
import shoal.worker                                                                                 # shoal

log = logging.getLogger("cnn_bn")


def build_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 4 * 4, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(),
        torch.nn.Linear(64, 10))


def evaluate(model: torch.nn.Module, loader: DataLoader, device: torch.device) -> float:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in loader:
            correct += (model(x.to(device)).argmax(1).cpu() == y).sum().item()
            total += len(y)
    model.train()
    return correct / total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.003)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loader-workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--accumulate", type=int, default=1, metavar="K", help="micro-batches per optimizer step")
    p.add_argument("--amp", action="store_true", help="autocast: fp16 with a GradScaler on CUDA, bf16 on the CPU")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: torch {torch.__version__} sees no CUDA device")
    if args.accumulate < 1:
        p.error(f"--accumulate {args.accumulate}: give 1 or more micro-batches per step")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.manual_seed(args.seed)
    (xtr, ytr), (xte, yte) = load(args.seed)
    train = TensorDataset(xtr.view(-1, 1, 8, 8), ytr)
    test = DataLoader(TensorDataset(xte.view(-1, 1, 8, 8), yte), batch_size=256)
    distributed = bool(os.environ.get("SHOAL_CHIEF"))

    model = build_model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True,
                        num_workers=args.loader_workers, pin_memory=device.type == "cuda")
    model, opt, loader = shoal.worker.distribute(model, opt, loader, seed=args.seed)              # shoal
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    fp16 = args.amp and device.type == "cuda"
    scaler = torch.amp.GradScaler(device.type, enabled=fp16)    # skips a step whose gradients overflow

    acc, k, passes = 0.0, args.accumulate, 0
    opt.zero_grad()
    for epoch in range(args.epochs):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.float16 if fp16 else torch.bfloat16, enabled=args.amp):
                loss = F.cross_entropy(model(x), y) / k
            scaler.scale(loss).backward()
            passes += 1
            if passes % k == 0:
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
        sched.step()
        acc = evaluate(model, test, device)
        log.info("epoch %d: test accuracy %.4f (lr %.5f)", epoch, acc, sched.get_last_lr()[0])
    if passes % k:                  # a last, short group of micro-batches
        scaler.step(opt)
        scaler.update()
    if distributed:                 # the job's final weights and statistics, for the run summary  # shoal
        opt.synchronize()
        acc = evaluate(model, test, device)
        opt.report(test_accuracy=acc)
    log.info("test accuracy %.4f", acc)


if __name__ == "__main__":
    main()
