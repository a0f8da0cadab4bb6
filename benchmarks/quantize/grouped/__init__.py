"""Issue #30's lever "fewer launches", as a measured prototype outside ``src``: one Triton launch that does
what ``adahop.kernels.quantize_fold.quantize_fold_fp8`` does for a list of 2-D tensors of different shapes
(the weights of all of a model's linear layers), bit for bit (``2026-12-05-grouped-prototype.md``)."""
