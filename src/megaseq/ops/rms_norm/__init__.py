"""Op ``rms_norm``: HF's RMSNorm (``reference``), the row-chunked backward run by default, and the fused Triton
kernel (``fused``, ``kernels``)."""
