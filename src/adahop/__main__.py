"""``python -m adahop``: the ``adahop`` command, also under ``torchrun ... -m adahop train ...``."""

import sys

from .cli import main

sys.exit(main())
