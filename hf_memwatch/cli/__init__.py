"""The ``hf-memwatch`` command line (``estimate``, ``report``); the dispatcher is :mod:`hf_memwatch.cli.main`."""
