"""The AdaHOP policy: outlier patterns, strategy tables, calibration votes and frozen plans.

Pure bookkeeping on top of plain tensors: nothing here quantizes (see ``adahop.formats``).
"""

from .calibration import (
    ModelPlan,
    PatternRecorder,
    PatternVotes,
    attach_pattern_hooks,
    end_calibration_step,
)
from .patterns import (
    DEFAULT_THRESHOLD,
    PATTERNS,
    NonFiniteTensorError,
    Pattern,
    PatternStats,
    detect_pattern,
    pattern_stats,
)
from .strategies import (
    GEMMS,
    LEVEL1,
    LEVEL2,
    ROLES,
    TABLES,
    LayerPlan,
    Strategy,
    StrategyTable,
    gemm_pattern_pairs,
    get_table,
    opposite,
    plan_for_patterns,
)

__all__ = [
    "DEFAULT_THRESHOLD",
    "GEMMS",
    "LEVEL1",
    "LEVEL2",
    "PATTERNS",
    "ROLES",
    "TABLES",
    "LayerPlan",
    "ModelPlan",
    "NonFiniteTensorError",
    "Pattern",
    "PatternRecorder",
    "PatternStats",
    "PatternVotes",
    "Strategy",
    "StrategyTable",
    "attach_pattern_hooks",
    "detect_pattern",
    "end_calibration_step",
    "gemm_pattern_pairs",
    "get_table",
    "opposite",
    "pattern_stats",
    "plan_for_patterns",
]
