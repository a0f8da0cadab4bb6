"""SIGTERM, what Slurm and Kubernetes send before they kill a job: the run finishes its step,
writes a checkpoint, prints where and how to resume, and exits with status 143 (128 + SIGTERM,
what a shell reports for a process SIGTERM ended: the run did not finish, so a job script or a
scheduler does not take it for a finished one; Ctrl-C's 130 is the same rule).

The signal handler only records the signal (and starts the grace timer); the training loop
asks :meth:`StopRequest.stop_now` at each step boundary. Several ranks must stop at the same
step, or the checkpoint's collectives would wait for a rank that trained on: a signalled rank
at the boundary after step s proposes step s + 1 in the process group's store, and every rank
reads the proposal at each boundary. No rank can be past step s + 1 by then, since every step
all-reduces its loss and the proposing rank has not joined that of step s + 1 yet. So SIGTERM to
every rank (torchrun forwards it to its workers) or to one alone stops all ranks at one step,
and they write one checkpoint together.

``training.sigterm_grace``: seconds from the signal after which the process exits without the
checkpoint, with the same line naming the last one (keep it under the scheduler's own grace:
Slurm's KillWait, Kubernetes' terminationGracePeriodSeconds and torchrun's --shutdown-timeout
all default to 30 s). ``training.sigterm_checkpoint=false``: SIGTERM stops at once, as Ctrl-C.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

import torch.distributed as dist

from .distributed import ParallelEnv

SIGTERM_EXIT_STATUS = 128 + signal.SIGTERM  # 143
_STOP_KEY = "adahop/stop_at_step"


class Terminated(BaseException):
    """SIGTERM stopped the run. A BaseException, as KeyboardInterrupt, so that ``except
    Exception`` lets it through. ``agreed``: every rank stopped at the same step boundary (and
    wrote the checkpoint); else the signal stopped this rank where it was."""

    def __init__(self, agreed: bool) -> None:
        super().__init__("terminated (SIGTERM)")
        self.agreed = agreed


class StopRequest:
    """Whether SIGTERM asked the run to stop and, on several ranks, at which step all stop."""

    def __init__(self) -> None:
        self.signalled = False
        self._stop_at: int | None = None

    def stop_now(self, step: int, env: ParallelEnv) -> bool:
        """Whether to stop at this boundary (``step`` steps done); a store round trip per step
        on several ranks, no wait for the device."""
        if not env.distributed:
            return self.signalled
        if self._stop_at is None:
            store = dist.distributed_c10d._get_default_store()
            if self.signalled and not store.check([_STOP_KEY]):
                store.set(_STOP_KEY, str(step + 1))
            if store.check([_STOP_KEY]):
                self._stop_at = int(store.get(_STOP_KEY))
        return self._stop_at is not None and step >= self._stop_at


@contextlib.contextmanager
def on_sigterm(stop: StopRequest, *, checkpoint: bool, grace_s: float, give_up: Callable[[], None]) -> Iterator[None]:
    """Within the block SIGTERM sets ``stop.signalled`` and starts a timer that calls
    ``give_up`` (which exits) after ``grace_s`` seconds; without ``checkpoint`` it raises
    :class:`Terminated` at once. Only the main thread can handle signals: elsewhere nothing
    changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    timers: list[threading.Timer] = []

    def handle(signum, frame) -> None:
        if not checkpoint:
            raise Terminated(agreed=False)
        if not stop.signalled:
            stop.signalled = True
            timers.append(threading.Timer(grace_s, give_up))
            timers[0].daemon = True
            timers[0].start()

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        for timer in timers:
            timer.cancel()
