"""Host-side helpers of the kernel launchers (no device code).

``INTERPRET`` tells launchers that Triton runs its interpreter (``TRITON_INTERPRET=1``: CPU
tensors, no autotuning, which needs a real device).
"""

from __future__ import annotations

import os

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def cdiv(a: int, b: int) -> int:
    """Ceiling division for launch grids: ``triton.cdiv`` is a JIT function, and calling one
    from Python costs a noticeable share of a kernel launch."""
    return -(-a // b)
