"""``megaseq bench`` and ``megaseq verify``: measurements of the planned training step against the plan and
against the transformers reference, and the per-layer kernel table with HF parity.

- ``measure``   one measured point (the trainer's step at one length: time, peak GPU and host memory, MFU)
- ``run``       the sweep over lengths and sources, ``--find-max``, ``--baseline`` (``run_bench``)
- ``reference`` the peer's timed step (``--baseline``), and the log-prob check against transformers
- ``peer``      the peer: transformers with Liger's kernels where they apply and PEFT's LoRA on the same targets
- ``tune``      ``megaseq tune``: the kernels tuned at a plan's lengths, written as a tuned table
- ``report``    markdown, JSON and PNG
- ``verify``    which kernel each layer runs, and parity with transformers

Nothing is imported here, so ``import megaseq.bench`` does no work.
"""
