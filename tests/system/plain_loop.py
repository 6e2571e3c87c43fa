"""The README's plain loop, adopted in one line: a test script for tests/system/test_user_script.py.

PLAIN_BUG_AT=N raises at each worker's step N (a script bug); PLAIN_NAN_AT=N makes worker0's loss NaN at its
step N; PLAIN_EPOCHS (default 3) and PLAIN_STEP_DELAY (seconds a step, default 0) make a longer job. Like most loops written for DDP, it reads ``loss.item()`` after its inner loop.
"""
import os
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import shoal.worker


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    epochs = int(os.environ.get("PLAIN_EPOCHS", "3"))
    delay = float(os.environ.get("PLAIN_STEP_DELAY", "0"))
    model, opt, loader = shoal.worker.distribute(model, opt, loader)
    bug_at = int(os.environ.get("PLAIN_BUG_AT", "0"))
    nan_at = int(os.environ.get("PLAIN_NAN_AT", "0")) if os.environ.get("SHOAL_LOCAL_INDEX") == "0" else 0
    step = 0
    for epoch in range(epochs):
        for xb, yb in loader:
            step += 1
            if step == bug_at:
                raise ValueError(f"a bug at step {step}")
            opt.zero_grad()
            loss = F.cross_entropy(model(xb), yb)
            if step == nan_at:
                loss = loss * float("nan")
            loss.backward()
            opt.step()
            time.sleep(delay)
        print(f"epoch {epoch}: loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
