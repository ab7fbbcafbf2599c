"""Parallelism applied from outside the model: the dp x ep x cp mesh, Ulysses and gather-KV context
parallelism (``SeqContext`` hooks as collectives), Ring-DTP for the vocabulary loss, gradient
reduction, and the launchers (torchrun, Ray, local processes). See docs/context_parallel.md.

Modules: ``mesh`` (layout, validation, batch sharding), ``ulysses`` (``UlyssesContext``),
``ring_dtp``, ``grads``, ``env`` (the trainer's ``DistributedEnv``), ``launch``.
Nothing is imported here, so ``import megaseq.parallel`` does no work.
"""
