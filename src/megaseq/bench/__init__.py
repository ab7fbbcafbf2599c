"""``megaseq bench`` and ``megaseq verify``: measurements of the planned training step against the plan and
against the transformers reference, and the per-layer kernel table with HF parity.

- ``measure``   one measured point (the trainer's step at one length: time, peak GPU and host memory, MFU)
- ``run``       the sweep over lengths and sources, ``--find-max``, ``--baseline`` (``run_bench``)
- ``reference`` the transformers baseline on the same weights, and the log-prob check
- ``report``    markdown, JSON and PNG
- ``verify``    which kernel each layer runs, and parity with transformers

Nothing is imported here, so ``import megaseq.bench`` does no work.
"""
