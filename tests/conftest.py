"""Test-wide settings: Triton kernels run in the interpreter when no GPU is present.

TRITON_INTERPRET must be set before triton is first imported, so it is set here.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, torch.get_num_threads()))
