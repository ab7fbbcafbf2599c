"""``models.build.build_model``: a model built in one place with its init drawn in another."""

import pytest
import torch

from megaseq.models.build import build_model
from megaseq.models.presets import PRESETS, get_preset

FAMILIES = ["kimi-linear-tiny", "qwen3-next-tiny", "glm5-flash-tiny", "gpt-oss-tiny"]


def bf16_base(model, dtype):
    """A frozen base's storage: every parameter in bf16 (``build_model(stored=...)``)."""
    return {name: torch.bfloat16 for name, _ in model.named_parameters()}


@pytest.mark.parametrize("name", sorted(n for n in PRESETS if n.endswith("-tiny")))
def test_a_base_made_in_its_storage_dtype_initialises_every_tensor(name):
    """The stored path (the model made on the meta device, each tensor allocated in its dtype, then HF's init)
    leaves no tensor as ``empty`` made it: each tensor the plain path makes constant (ones, zeros) is that
    constant (a block whose constructor makes its own ones, such as Qwen3-Next's gated norm, needs an init of
    its own)."""
    spec = get_preset(name)
    plain = build_model(spec, dtype=torch.bfloat16, device="cpu", seed=0)
    made = dict(build_model(spec, dtype=torch.bfloat16, device="cpu", seed=0, stored=bf16_base).named_parameters())
    for k, p in plain.named_parameters():
        if p.numel() > 1 and bool((p == p.flatten()[0]).all()):
            assert torch.equal(made[k].float(), p.float()), k


@pytest.mark.parametrize("name", FAMILIES)
def test_an_init_drawn_elsewhere_is_the_init_and_stays_in_its_storage(name):
    """``reset_parameters(draw_on=...)`` makes the values the plain init makes, written into the parameters'
    own storage (a streamed base's host buffers are made from it): every tensor the inits reach, including
    those an ``init_weights`` writes into a child (Kimi's forget gate)."""
    spec = get_preset(name)
    model = build_model(spec, device="cpu", seed=0, stored=bf16_base)
    torch.manual_seed(5)
    model.reset_parameters()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    ptrs = {k: p.data_ptr() for k, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    torch.manual_seed(5)
    model.reset_parameters(draw_on=torch.device("cpu"))
    got = model.state_dict()
    assert {k: p.data_ptr() for k, p in model.named_parameters()} == ptrs
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    if spec.tie_word_embeddings:
        assert model.lm_head.weight is model.embed_tokens.weight


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", FAMILIES)
def test_a_host_model_drawn_on_the_gpu_equals_the_model_built_there(name):
    """A base built in host memory with ``draw_on`` the GPU has, bit for bit, the weights of the same seed's
    model built on the GPU (what a streamed base's run gets is what a resident run gets)."""
    spec = get_preset(name)
    gpu = build_model(spec, device="cuda", seed=3, stored=bf16_base)
    host = build_model(spec, device="cpu", seed=3, stored=bf16_base, draw_on="cuda")
    assert all(p.device.type == "cpu" for p in host.parameters())
    ref = gpu.state_dict()
    for k, v in host.state_dict().items():
        assert torch.equal(v, ref[k].cpu()), k
