"""Issue #30's lever "one read, both orientations": X (and dY) quantized row-wise into the folded FP8 operand and
column-wise into packed MXFP4 from a single read of the bf16 source, measured against today's two kernels
(``2026-12-05-bothways.md``)."""
