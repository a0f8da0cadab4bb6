"""adahop inside other trainers: ``adahop.integrations.torchtitan`` and ``adahop.integrations.transformers``.

Each module imports its framework; install it with the extra of the same name
(``pip install "adahop[torchtitan]"``).
"""
