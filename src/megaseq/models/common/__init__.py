"""The blocks every family is assembled from, and the decoder they share.

- ``decoder``   ``CausalLM``: embedding, the layer loop, final norm, head, tying, HF's initialisation
- ``context``   ``SeqContext``: documents, positions and the hooks through which token mixers reach
                sequence-level schemes (context parallelism, sequence segments) without knowing them
- ``norm``, ``mlp``, ``moe``, ``attention`` (GQA + RoPE), ``kda`` (Kimi Delta Attention),
  ``mla_dsa`` (MLA + DeepSeek sparse attention + the lightning indexer), ``mhc`` (hyper-connections)
- ``state_dict_adapter``  HF checkpoint keys <-> megaseq names (a family subclasses it)

Nothing here imports ``megaseq.memory`` or ``megaseq.parallel`` (import-linter checks it).
"""
