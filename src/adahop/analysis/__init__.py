"""Looking at runs: loss-curve comparison and per-layer outlier analysis."""
