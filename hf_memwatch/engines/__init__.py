"""The data-parallel engines: one folder each, registered in one table.

Layout (each engine owns its live measurement, its replay rules, its advice; ``tests/engines/`` its tests):

==================  ==========================================================================
``registry``        ``ENGINES``: one :class:`~.rules.EngineRules` per engine, one line each (the
                    last, the base, is one process); what the estimator (:func:`~.registry.rules_for`),
                    the monitor (:func:`~.registry.make_monitor`), the planner
                    (:func:`~.registry.engine_advice`, :func:`~.registry.eight_bit_unavailable`,
                    :func:`~.registry.no_fit_reasons`) and the CLI (:func:`~.registry.engine_of_options`) ask
``rules``           ``EngineRules``: an engine's methods at each floor, defaults for one process
``alternatives``    the engine changes a "no plan fits" stop re-estimates (a higher ZeRO stage, offload)
``engine``          ``Engine``, the engine as accelerate builds it, read from the Trainer's accelerator,
                    its arguments or the launcher's environment; ``SHARDS``
``shard``           the per-rank division of the model states (DDP's buckets, ZeRO's and FSDP's shares)
``gloo_staging``    gloo: the copy it stages for a CPU all-gather (the live tracker counts it), its held works
``ddp/``            ``rules``, ``live`` (the reducer's buckets on a rank), ``replay`` (its CUDA blocks)
``zero/``           ``rules``, ``live`` (the partitions), ``backward``, ``step``, ``gather`` (the replay),
                    ``advice`` (ZeRO stage, offload, bucket; DDP's: ZeRO-1)
``fsdp1/``          ``rules`` (accelerate's ``fsdp_version: 1``: the full-shard division, measured)
``fsdp2/``          ``rules``, ``live`` (shards, gathered units, buffers), ``replay`` over ``units``
==================  ==========================================================================

**How the layers stay acyclic.** The package spans the floors of the house (``core -> measure ->
estimation -> planning -> ...``, ``tests/test_house.py``): each module sits on the floor of the layer it
serves, read off its name — ``engine`` on ``core``'s (``RunConfig`` reads it), ``live`` and
``gloo_staging`` on ``measure``'s (the tracker imports gloo's staging), every other module (the replay
rules, the advice, ``rules`` and ``registry``) on ``estimation``'s. The registry is an engine object per
entry with methods (not a table of modules imported by name): it imports each engine's ``rules``, which
import that engine's modules, which import only lower floors or their own. The estimator, which is on
the same floor, imports the registry and never an engine module; the planner, the integration and the
CLI are above it. Nothing is imported inside a function to dodge a cycle, and the house test checks
every import, at any depth, against the importing module's floor. What the layers below need from an
engine is passed to them as plain values (a ``StorageContributor`` for the monitor, a context and
per-rank classes for the replay, ``Advice`` — defined in ``core`` — for the planner).

**Adding an engine**: a folder with a ``rules`` module (an ``EngineRules`` subclass overriding what the
engine does) and the modules it hands over to, and one line in ``registry.ENGINES``; a new ``shard``
name also goes into ``engine.SHARDS`` (the CLI checks its arguments against it before importing torch).
No other module names an engine (``tests/test_house.py`` fails on an engine-kind check outside this package).
"""
