"""Worker role: the library a training script uses, and the ``shoal worker`` launcher.

    from shoal.worker import Trainer
    trainer = Trainer(model, optimizer="adam", lr=1e-3)
    for x, y in trainer.batches((X, Y), batch_size=64, epochs=5):
        trainer.zero_grad()
        loss_fn(model(x), y).backward()
        trainer.step()          # push gradients, pull weights
"""
from shoal.worker.trainer import Trainer

__all__ = ["Trainer"]
