"""Op ``indexer_topk`` (the DSA lightning indexer's pool selection): the fp32 reference (``scoring``), the Triton
launcher (``topk``), its scoring kernel (``topk_kernel``) and its exact selection (``select``)."""
