"""Which of torchtitan's linear layers become ``AdaHOPLinear``."""

from __future__ import annotations

from ...recipes import name_matches
from ...recipes import Recipe

DEFAULT_MIN_FEATURES = 256


def should_convert(
    fqn: str, in_features: int, out_features: int, recipe: Recipe, exclude: list[str], min_features: int
) -> bool:
    """True unless ``fqn`` matches ``recipe.exclude`` or ``exclude`` (fnmatch on the name or its
    last part; the LM head by default), a dimension is not a multiple of the MX block, or the
    layer is smaller than ``min_features`` on either side (4-bit GEMMs that small save nothing
    and cost accuracy)."""
    if name_matches(fqn, (*recipe.exclude, *exclude)):
        return False
    block = recipe.block_size
    return in_features % block == 0 and out_features % block == 0 and min(in_features, out_features) >= min_features
