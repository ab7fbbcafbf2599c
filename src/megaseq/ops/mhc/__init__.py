"""Ops of the manifold-constrained hyper-connections (mHC): ``hc_mix``, ``hc_weights``, ``hc_collapse`` and
``hc_merge``. ``reference`` holds the pure-torch references; ``mix_fused`` the closed-form ``torch_fused``
``hc_mix``; ``*_triton`` / ``*_kernels`` the Triton launchers and kernels."""
