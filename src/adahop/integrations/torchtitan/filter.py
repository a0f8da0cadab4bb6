"""torchtitan's default for which linear layers stay ``Linear`` (the rule: ``nn.convert.conversion_verdict``)."""

# Layers with fewer features on either side stay Linear under the torchtitan converters by default:
# 4-bit GEMMs that small save nothing, and a mixture-of-experts router (one output per expert) is one.
DEFAULT_MIN_FEATURES = 256
