"""One call to go distributed: ``model, opt, loader = shoal.worker.distribute(model, opt, loader)``.

It takes what the script already has and returns the distributed versions: the
same model object, the user's optimizer wrapped by
:func:`~shoal.worker.DistributedOptimizer` (same class, param groups,
hyper-parameters, schedulers), and a DataLoader like the user's (workers,
pinning, collate, ``drop_last``, ...) whose sampler is a
:class:`~shoal.worker.DistributedSampler` over the chief's data tasks. The
sampler's batch size is the DataLoader's and it shuffles when the DataLoader
did; the number of epochs comes, first found, from ``epochs=``, the launcher's
``--epochs`` (``$SHOAL_EPOCHS``), the job file's ``train.epochs``, or the calling
function's own ``epochs`` variable or ``args.epochs`` (an argparse namespace);
the loop may still call ``loader.sampler.set_epoch(e)``. Outside a shoal job
(no ``$SHOAL_CHIEF`` and no ``chief=``) the three come back unchanged, so the
same script runs in one process.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

from shoal.errors import InvalidArgument
from shoal.settings.jobfile import job_from_env
from shoal.worker.optimizer import DistributedOptimizer
from shoal.worker.sampler import DistributedSampler

log = logging.getLogger(__name__)

EPOCHS_ENV = "SHOAL_EPOCHS"


def distribute(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader, *,
               epochs: int | None = None, seed: int | None = None, batches_per_task: int = 4,
               **options: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer, DataLoader]:
    """``(model, optimizer, loader)`` for this worker of the job; unchanged outside a job.

    ``options`` go to :func:`~shoal.worker.DistributedOptimizer` (``chief``, ``compression``,
    ``backward_passes_per_step``, ...). ``seed`` (default: the job file's ``train.seed``, else 0) seeds
    each epoch's shuffle, the same on every worker."""
    if not (options.get("chief") or os.environ.get("SHOAL_CHIEF")):
        return model, optimizer, loader
    sampler_kwargs = _sampler_settings(loader)           # checked before joining the job
    epochs = _epochs(epochs, sys._getframe(1))
    train = _train_section()
    seed = seed if seed is not None else int(train.get("seed", 0))
    opt = DistributedOptimizer(optimizer, model, **options)
    sampler = DistributedSampler(loader.dataset, epochs=epochs, seed=seed, batches_per_task=batches_per_task,
                                 trainer=opt.trainer, **sampler_kwargs)
    log.info("distributed: batch size %d, %d epoch(s), %s", sampler.batch_size, epochs,
             "shuffled" if sampler.shuffle else "in order")
    return model, opt, _with_sampler(loader, sampler)


def _sampler_settings(loader: DataLoader) -> dict[str, Any]:
    if not isinstance(loader, DataLoader):
        raise InvalidArgument(f"distribute() takes a torch DataLoader, got {type(loader).__name__}")
    if isinstance(loader.dataset, IterableDataset):
        raise InvalidArgument("distribute() needs a map-style dataset (len() and indexing): the chief hands out "
                              f"ranges of sample indices, and {type(loader.dataset).__name__} is iterable-only")
    if loader.batch_size is None:
        raise InvalidArgument("distribute() takes the batch size from DataLoader(batch_size=N); this DataLoader "
                              "has a batch_sampler instead")
    if isinstance(loader.sampler, RandomSampler):
        if loader.sampler.replacement or loader.sampler.num_samples != len(loader.dataset):
            raise InvalidArgument("distribute(): a RandomSampler with replacement or num_samples cannot be kept; "
                                  "each epoch visits every sample once")
        shuffle = True
    elif isinstance(loader.sampler, SequentialSampler):
        shuffle = False
    else:
        raise InvalidArgument(f"distribute() replaces the DataLoader's sampler with the chief's data tasks; its "
                              f"{type(loader.sampler).__name__} cannot be kept (use shuffle=True or False)")
    return {"batch_size": loader.batch_size, "shuffle": shuffle}


def _train_section() -> dict[str, Any]:
    job = job_from_env()
    return job.section("train") if job is not None else {}


def _epochs(given: int | None, caller: Any) -> int:
    """The job's epoch count: ``epochs=``, ``$SHOAL_EPOCHS``, the job file, or the caller's variables."""
    found: list[tuple[Any, str]] = [(given, "epochs="), (os.environ.get(EPOCHS_ENV), f"${EPOCHS_ENV}"),
                                    (_train_section().get("epochs"), "the job file's train.epochs")]
    local = caller.f_locals if caller is not None else {}
    found.append((local.get("epochs"), "the script's variable epochs"))
    found += [(getattr(v, "epochs", None), f"the script's {k}.epochs") for k, v in local.items()
              if isinstance(v, argparse.Namespace)]
    for value, where in found:
        if value is None or value == "":
            continue
        try:
            n = int(value)
        except (TypeError, ValueError):
            raise InvalidArgument(f"distribute(): {where} is {value!r}, not a number of epochs") from None
        if n < 1 or isinstance(value, bool):
            raise InvalidArgument(f"distribute(): {where} is {value!r}; give 1 or more epochs")
        return n
    raise InvalidArgument("distribute() cannot tell how many epochs the job trains: pass epochs=N, run "
                          "shoal local/worker --epochs N, or set train.epochs in the job file")


def _with_sampler(loader: DataLoader, sampler: DistributedSampler) -> DataLoader:
    """A DataLoader like ``loader`` (its workers, pinning, collate, ...) that draws from ``sampler``."""
    kwargs: dict[str, Any] = dict(
        batch_size=loader.batch_size, sampler=sampler, num_workers=loader.num_workers, collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory, drop_last=loader.drop_last, timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn, multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator, persistent_workers=loader.persistent_workers,
        pin_memory_device=loader.pin_memory_device)
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    if hasattr(loader, "in_order"):
        kwargs["in_order"] = loader.in_order
    return DataLoader(loader.dataset, **kwargs)
