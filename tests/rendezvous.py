"""Race-free rendezvous for every test that starts ranks.

Picking a free port and handing its number to the ranks races: another process on a busy
machine can take the port before rank 0 binds it (``EADDRINUSE``). Here the test process binds
the store itself, on port 0 (the kernel picks a free port at bind time), and keeps it open; the
ranks join it as clients, exactly as torchrun's workers join the store their agent bound
(``TORCHELASTIC_USE_AGENT_STORE``; ``torchrun --standalone`` binds ``localhost:0`` the same
way). Tests that call ``init_process_group`` themselves may use ``init_method=file://`` in
``tmp_path`` instead.
"""

from __future__ import annotations

import torch.distributed as dist


class HostedStore:
    """A TCPStore served by this process for ONE process group (a finished group's keys would
    confuse the next); keep the object alive until the ranks are done."""

    def __init__(self) -> None:
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)

    @property
    def env(self) -> dict[str, str]:
        """The variables (besides RANK, LOCAL_RANK, WORLD_SIZE) a rank needs to join the group with ``env://``."""
        return {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(self.store.port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }
