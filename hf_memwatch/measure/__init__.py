"""Measurement: allocator backends, the CPU storage tracker, attribution to memory classes, the step monitor."""
