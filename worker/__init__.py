"""Worker role: the library a training script uses, and the ``shoal worker`` launcher.

A plain PyTorch loop, one line added (and the import)::

    model, opt, loader = shoal.worker.distribute(model, opt, loader)

or the three-line form, each part by hand::

    opt = DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3), model)    # wraps the optimizer
    sampler = DistributedSampler(train_set, batch_size=64, epochs=5)                     # the chief's tasks
    loader = DataLoader(train_set, batch_size=64, sampler=sampler, num_workers=2)        # was: shuffle=True
    for epoch in range(5):
        for x, y in loader:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()          # push gradients, pull weights

A model's embedding tables can live on the parameter servers instead (never on a worker): build
``nn.Embedding``/``nn.EmbeddingBag(sparse=True)`` on the ``meta`` device, or use
:class:`ShardedEmbedding`/:class:`ShardedEmbeddingBag` (docs/embeddings.md).

The lower layer, :class:`Trainer`, takes an optimizer by name and yields batches itself
(``trainer.batches(data, batch_size, epochs)``).
"""
from shoal.worker.embedding import ShardedEmbedding, ShardedEmbeddingBag, table_options
from shoal.worker.optimizer import DistributedOptimizer
from shoal.worker.sampler import DistributedSampler
from shoal.worker.trainer import Trainer
from shoal.worker.distribute import distribute

__all__ = ["DistributedOptimizer", "DistributedSampler", "ShardedEmbedding", "ShardedEmbeddingBag", "Trainer",
           "distribute", "table_options"]
