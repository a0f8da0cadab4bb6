"""``split_dataset_by_node`` of the ``datasets`` stand-in (see the package docstring)."""

from . import Dataset


def split_dataset_by_node(dataset: Dataset, rank: int, world_size: int) -> Dataset:
    """Rank ``rank``'s contiguous share, as ``datasets`` splits a map-style dataset."""
    return dataset if world_size == 1 else dataset.shard(world_size, rank, contiguous=True)
