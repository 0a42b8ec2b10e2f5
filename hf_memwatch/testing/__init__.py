"""Test oracles, documented for users who check hf-memwatch's figures themselves.

* :mod:`hf_memwatch.testing.truth` — PyTorch's own accounting of CPU memory (the profiler's
  ``[memory]`` events), the reference every CPU figure of hf-memwatch is checked against;
* :mod:`hf_memwatch.testing.estimate_truth` — a real Trainer run's measured step peak, for
  comparing :func:`hf_memwatch.estimate` with what a run really needs.

Not imported by the library's training path.
"""

# The profiler range of one optimizer step: StepMarker (step_marker) opens it, truth's step_peaks reads it.
STEP_MARK = "hf_memwatch.testing.truth.step"
