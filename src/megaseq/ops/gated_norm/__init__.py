"""Op ``gated_rms_norm`` (KDA's output norm ``weight * rmsnorm(x) * sigmoid(gate)``): the reference
(``reference``) and fla's fused kernel (``fla``)."""
