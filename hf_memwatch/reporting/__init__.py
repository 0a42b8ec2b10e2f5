"""Reporting: scalars for TensorBoard/W&B, the picture, the console summary, the OOM post-mortem."""
