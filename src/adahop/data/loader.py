"""Batches of (inputs, targets) windows from a token array, resumable exactly.

The array is cut into non-overlapping windows of ``seq_len + 1`` tokens (neighbours share one
token: the last target of one is the first input of the next). Each epoch visits every window
once in an order drawn from ``(seed, epoch)`` alone, so the data position is two integers and a
resumed run draws exactly the batches the uninterrupted run would have.

Data-parallel ranks share one order: ``batch_size`` is the global batch, and rank r of W takes
rows [r b, (r + 1) b) of it (b = batch_size / W). The shares are disjoint, together they are
the single-process batch, and the position counts global batches, so it means the same on any
number of ranks.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

Batch = tuple[torch.Tensor, torch.Tensor]


def windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> Batch:
    """int64 inputs and next-token targets [len(starts), seq_len] for windows at ``starts``."""
    rows = np.stack([tokens[s : s + seq_len + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(rows[:, :-1].copy()), torch.from_numpy(rows[:, 1:].copy())


def num_windows(tokens: np.ndarray, seq_len: int) -> int:
    return (len(tokens) - 1) // seq_len


class BatchLoader:
    """Shuffled training batches, an endless iterator; the partial batch at the end of an
    epoch is dropped. With ``world_size > 1`` it yields rank ``rank``'s share of each batch."""

    def __init__(
        self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int = 0, *, rank: int = 0, world_size: int = 1
    ) -> None:
        if batch_size % world_size:
            raise ValueError(
                f"data.batch_size={batch_size} (the global batch) does not split evenly over {world_size} ranks; "
                f"use a multiple of {world_size}"
            )
        n = num_windows(tokens, seq_len)
        if n < batch_size:
            raise ValueError(
                f"{len(tokens)} training tokens make {n} windows of seq_len {seq_len}, "
                f"fewer than one batch of {batch_size}; use more data or a smaller batch"
            )
        self.tokens, self.batch_size, self.seq_len, self.seed = tokens, batch_size, seq_len, seed
        share = batch_size // world_size
        self._rows = slice(rank * share, (rank + 1) * share)  # this rank's rows of a batch
        self.epoch, self.position = 0, 0  # the next batch starts at order[position]
        self._order = self._epoch_order(0)
        # A resume that accepted changed data (``--accept-changed-data``): a position saved for
        # another token count goes on at the same epoch and position in this data's order.
        self.accepts_other_tokens = False

    def _epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(num_windows(self.tokens, self.seq_len))

    def __iter__(self) -> BatchLoader:
        return self

    def __next__(self) -> Batch:
        if self.position + self.batch_size > len(self._order):
            self.epoch, self.position = self.epoch + 1, 0
            self._order = self._epoch_order(self.epoch)
        picked = self._order[self.position : self.position + self.batch_size][self._rows]
        self.position += self.batch_size
        return windows(self.tokens, picked * self.seq_len, self.seq_len)

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "num_tokens": len(self.tokens),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        saved = (state["seed"], state["seq_len"], state["num_tokens"])
        current = (self.seed, self.seq_len, len(self.tokens))
        if saved != current and not (self.accepts_other_tokens and saved[:2] == current[:2]):
            raise ValueError(
                f"data position was saved for (seed, seq_len, num_tokens) = {saved}, "
                f"but this loader has {current}: the data or its settings changed"
            )
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._epoch_order(self.epoch)


def validation_batches(
    tokens: np.ndarray, batch_size: int, seq_len: int, max_batches: int | None = None
) -> Iterator[Batch]:
    """The same held-out windows on every call: consecutive windows from the start of
    ``tokens``, at most ``max_batches`` batches (the last one may be smaller)."""
    n = num_windows(tokens, seq_len)
    if n == 0:
        raise ValueError(
            f"the validation split has {len(tokens)} tokens, fewer than one window of "
            f"seq_len + 1 = {seq_len + 1}; raise val_fraction or use more data"
        )
    if max_batches is not None:
        n = min(n, max_batches * batch_size)
    starts = np.arange(n) * seq_len
    return (windows(tokens, starts[i : i + batch_size], seq_len) for i in range(0, n, batch_size))
