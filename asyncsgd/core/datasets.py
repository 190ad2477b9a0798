"""Training data from a map-style ``torch.utils.data.Dataset``, behind the ``Split`` interface.

A task's ``train`` or ``test`` may be a Dataset instead of tensors; ``DatasetSplit`` reads and
collates it batch by batch, so every mode partitions and orders its rows as it does tensors.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from ..errors import TaskError


class DatasetSplit:
    """One split of a data set read from a map-style ``Dataset`` of ``(input, ..., target)``
    items; ``rows(index)`` collates them as a ``DataLoader`` would.

    Used exactly as a ``Split`` (``len``, ``rows``, ``share_memory_()``), so which rows a
    process reads is still decided in ``core.tasks`` (``partition_indices``,
    ``epoch_order``), alike for tensors and Datasets in every mode. The last element of an
    item is the target, the others the model's inputs. ``rows`` reads ``dataset[i]``
    afresh each time, so random augmentations stay random.

    No ``num_workers`` loader processes: each training process already is one of N
    sharing the cores, and W loaders each would oversubscribe them N x (1 + W) times. A
    Dataset whose reads are slow is better pre-decoded into tensors (a ``Split``). The
    Dataset travels to spawned processes by pickling, as to a ``DataLoader``'s workers:
    define its class and transforms at module level."""

    def __init__(self, dataset: Dataset, which: str = "split"):
        self.dataset, self.which = dataset, which
        try:
            self.size = len(dataset)
        except TypeError as exc:
            raise TaskError(f"the {which} Dataset {type(dataset).__name__} has no len(): a "
                            "Dataset split needs a map-style Dataset with __len__ and "
                            "__getitem__") from exc

    def __len__(self) -> int:
        return self.size

    def rows(self, index: torch.Tensor) -> tuple:
        """``(inputs, targets)`` for the rows in ``index``: the Dataset's items, transformed
        by the Dataset, collated with ``default_collate``."""
        items = [self.dataset[i] for i in index.tolist()]
        for item in items[:1]:
            if not isinstance(item, (tuple, list)) or len(item) < 2:
                raise TaskError(
                    f"the {self.which} Dataset {type(self.dataset).__name__} returned a "
                    f"{type(item).__name__}; its items must be tuples (input, ..., target): "
                    "the last element is the target, the others the model's inputs")
        batch = default_collate(items)
        for position, value in enumerate(batch):
            if not isinstance(value, torch.Tensor):
                raise TaskError(
                    f"element {position} of the {self.which} Dataset "
                    f"{type(self.dataset).__name__}'s items collates to a "
                    f"{type(value).__name__}, not a tensor: return tensors, numbers or numpy "
                    "arrays (convert the rest in the Dataset's transform)")
        return tuple(batch[:-1]), batch[-1]

    def share_memory_(self) -> "DatasetSplit":
        """Nothing to move: the Dataset is pickled to each process, and torch moves the
        tensors it holds into shared memory on the way."""
        return self

    def fingerprint(self) -> str:
        """What the handshake compares of this split beyond its length: the Dataset's class.
        Reading items would run the user's transforms (random, slow or with side
        effects) in the server, which never trains on them."""
        kind = type(self.dataset)
        return f"dataset {kind.__module__}.{kind.__qualname__}"


def dataset_split(value, which: str):
    """``value`` as a split: a ``DatasetSplit`` for a map-style ``Dataset``; one clear error
    for what cannot be one."""
    if isinstance(value, DataLoader):
        raise TaskError(f"the task's {which} is a DataLoader: pass its Dataset instead "
                        f"({which}=loader.dataset); asyncsgd partitions the rows between "
                        "processes and makes the batches itself")
    if isinstance(value, IterableDataset):
        raise TaskError(f"the task's {which} is an IterableDataset, which cannot be read by "
                        "index: each process must read its own disjoint rows, so use a "
                        "map-style Dataset (__len__ and __getitem__) or tensors (Split)")
    if isinstance(value, Dataset):
        return DatasetSplit(value, which)
    raise TaskError(f"the task's {which} is a {type(value).__name__}: give a Split of tensors "
                    "or a map-style torch.utils.data.Dataset of (input, ..., target) items")
