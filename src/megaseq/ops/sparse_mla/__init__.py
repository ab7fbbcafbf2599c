"""Op ``sparse_attention`` (MLA over each query's selected keys): the masked reference (``reference``), the
absorbed torch implementation (``absorbed``) and the Triton kernels (``fused``, ``kernels``)."""
