"""``train.update_overlap``: the update's parts in the order the next forward reads them, MasterAdamW's step in
parts equal to its one step (float64, CPU), where the run overlaps and where the trainer waits for the update
(CPU); on a GPU, the update on its own stream gives the weights and losses of the update on the compute stream,
bit for bit, with the update held back by a delay, and a forward that does not wait for it differs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from megaseq.memory.master_adam import MasterAdamW
from megaseq.train import update_overlap
from megaseq.train.update_overlap import UpdateOverlap, parts_in_forward_order


class Tiny(nn.Module):
    """The decoder interface the overlap reads: ``embed_tokens``, ``layers``, ``norm``, ``lm_head`` (tied or not)."""

    def __init__(self, vocab: int = 50, hidden: int = 16, layers: int = 3, tied: bool = False) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        wide = 4 * hidden
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, wide), nn.GELU(), nn.Linear(wide, hidden)) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(ids)
        for layer in self.layers:
            h = h + layer(h)
        return self.lm_head(self.norm(h))


@pytest.mark.parametrize("tied", [False, True])
def test_the_parts_follow_the_forward_and_hold_every_trained_parameter_once(tied):
    model = Tiny(tied=tied)
    model.layers[1][0].weight.requires_grad_(False)  # frozen: not the optimizer's
    opt = MasterAdamW([p for p in model.parameters() if p.requires_grad])
    parts = parts_in_forward_order(model, opt)
    assert len(parts) == 4
    mods, first = parts[0]
    assert mods[0] is model and {id(m) for m in mods[1:]} == {id(model.embed_tokens), id(model.norm), id(model.lm_head)}
    assert first == {model.embed_tokens.weight, model.norm.weight, model.norm.bias, model.lm_head.weight}
    for i, (mods, ps) in enumerate(parts[1:]):
        assert mods == [model.layers[i]] and ps == {p for p in model.layers[i].parameters() if p.requires_grad}
    every = [p for _, ps in parts for p in ps]
    assert len(every) == len({id(p) for p in every}) == sum(1 for p in model.parameters() if p.requires_grad)


def test_graphed_layers_parts_go_first_and_their_forwards_wait_for_all_of_them():
    """With layers 0 and 2 graphed: the parts run outer, 0, 2, then 1, and a graphed layer's forward waits for
    the part of layer 2 (the graphs' pool holds their gradients until the last is read); without graphs, the
    forward's order."""
    from types import SimpleNamespace

    model = Tiny()
    overlap = UpdateOverlap.__new__(UpdateOverlap)
    overlap.model, overlap.graphs = model, SimpleNamespace(graphed=[0, 2])
    overlap.parts = parts_in_forward_order(model, MasterAdamW(model.parameters()))
    parts, wait = overlap._order()
    assert [mods[0] for mods, _ in parts] == [model, model.layers[0], model.layers[2], model.layers[1]]
    assert wait == 2
    overlap.graphs = None
    parts, wait = overlap._order()
    assert parts == overlap.parts and wait == 0


def _grads(model: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)


def test_a_step_in_parts_is_the_one_step():
    """float64, torch's AdamW: the step launched part by part (clipped, guarded) leaves every weight, master and
    moment as the one step does; ``after_part`` hears each part in order. A part missing a parameter is refused."""
    torch.manual_seed(0)
    one = Tiny().double()
    split = copy.deepcopy(one)
    opts = [MasterAdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (one, split)]
    parts = [ps for _, ps in parts_in_forward_order(split, opts[1])]
    heard = []
    for step in range(3):
        for m, opt in zip((one, split), opts, strict=True):
            _grads(m, step)
            opt.clip_grad_norm_(0.5)
        finite = torch.tensor(True)
        opts[0].step(finite=finite)
        opts[1].step(finite=finite, parts=parts, after_part=heard.append)
        for opt in opts:
            opt.zero_grad()
    assert heard == [0, 1, 2, 3] * 3
    for (n, a), b in zip(one.named_parameters(), split.parameters(), strict=True):
        assert torch.equal(a, b), n
        for k in ("master", "exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opts[0].state[a][k], opts[1].state[b][k]), (n, k)
    _grads(split, 9)
    with pytest.raises(ValueError, match="no part holds"):
        opts[1].step(parts=parts[1:])


def test_why_a_run_s_update_stays_on_the_compute_stream():
    opt = MasterAdamW(Tiny().parameters())
    cuda = torch.device("cuda")
    assert update_overlap.why_not(False, cuda, 1, opt) == "optim.overlap_update is off"
    assert update_overlap.why_not(True, torch.device("cpu"), 1, opt) == "device cpu"
    assert update_overlap.why_not(True, cuda, 2, opt) == "2 processes"
    assert update_overlap.why_not(True, cuda, 1, torch.optim.AdamW(Tiny().parameters())) == "optimizer AdamW"
    assert update_overlap.why_not(True, cuda, 1, opt) is None
    logged = []
    assert update_overlap.for_run(True, Tiny(), opt, torch.device("cpu"), 1, logged.append) is None and not logged


class _Recording:
    """An overlap that records what the trainer asks of it (CPU: no stream)."""

    def __init__(self, opt) -> None:
        self.opt, self.calls = opt, []

    def step(self, finite) -> None:
        self.calls.append("step")
        self.opt.step(finite=finite)

    def join(self) -> None:
        self.calls.append("join")


def test_the_trainer_steps_through_the_overlap_and_waits_for_it_before_a_checkpoint(tmp_path, monkeypatch):
    """``train_step`` hands the guarded update to the overlap; the loop waits for it (``join``) before each
    checkpoint and at the end of the run, and not between plain steps."""
    from test_train import _cfg

    from megaseq.train import step as step_mod
    from megaseq.train.trainer import run_training

    made = []
    real_of = step_mod.StepState.of

    def of(*a, **k):
        state = real_of(*a, **k)
        state.overlap = _Recording(state.optimizer)
        made.append(state)
        return state

    monkeypatch.setattr(step_mod.StepState, "of", of)
    run_training(_cfg(tmp_path, "o", train={"steps": 3, "save_every": 2}, model={"weights": "bf16", "dtype": "bf16"}))
    calls = made[0].overlap.calls
    # steps 1, 2 (saved), 3 (saved, the last), then the run's end
    assert calls == ["step", "step", "join", "step", "join", "join"], calls


# ---- GPU -----------------------------------------------------------------------------------------------------
CUDA = torch.device("cuda")


def _run(model, opt, overlap, batches, delay: int = 0):
    """Steps of ``model`` on ``batches``: loss, backward, clip, the guarded update (on the overlap's stream, held
    back ``delay`` GPU cycles first, or on the compute stream); the losses read back each step."""
    losses = []
    if delay:
        real = opt.step

        def delayed(*a, **k):
            torch.cuda._sleep(delay)  # on the stream the update runs on
            return real(*a, **k)

        opt.step = delayed
    for ids, labels in batches:
        logits = model(ids)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        loss.backward()
        norm = opt.clip_grad_norm_(1.0)
        finite = torch.isfinite(loss) & torch.isfinite(norm)
        if overlap is not None:
            overlap.step(finite)
        else:
            opt.step(finite=finite)
        losses.append(loss.item())
        opt.zero_grad()
    if overlap is not None:
        overlap.join()
    torch.cuda.synchronize()
    return losses


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_overlapped_update_gives_the_compute_stream_s_weights_bit_for_bit():
    """bf16 weights, MasterAdamW's Triton pass, five steps: the update on its own stream, held back 50 ms each
    step, gives the losses and weights of the update on the compute stream exactly; the gradients are given back
    once the next forward has entered the last layer. The same overlap whose forward does not wait for the
    update reads the weights before it: its second step's loss differs."""
    torch.manual_seed(0)
    base = Tiny(vocab=512, hidden=1024, layers=4).to(CUDA, torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 512, (2, 256), generator=gen).to(CUDA),
                torch.randint(0, 512, (2, 256), generator=gen).to(CUDA)) for _ in range(5)]

    def fresh():
        model = copy.deepcopy(base)
        return model, MasterAdamW(model.parameters(), lr=1e-2, fused=True, kernel="triton")  # as the trainer builds it

    model_a, opt_a = fresh()
    ref = _run(model_a, opt_a, None, batches)
    model_b, opt_b = fresh()
    overlap = UpdateOverlap(model_b, opt_b, CUDA)
    got = _run(model_b, opt_b, overlap, batches, delay=100_000_000)
    assert got == ref
    for (n, a), b in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        assert torch.equal(a, b), n
    # after a step, the next forward's last layer gives the gradients back
    model_b(batches[0][0]).sum().backward()
    opt_b.clip_grad_norm_(1.0)
    overlap.step(torch.tensor(True, device=CUDA))
    assert overlap.held
    with torch.no_grad():
        model_b(batches[0][0])
    assert not overlap.held and not overlap.pending

    model_c, opt_c = fresh()
    broken = UpdateOverlap(model_c, opt_c, CUDA)
    for hook in broken.hooks:  # the forward no longer waits for the update
        hook.remove()
    got = _run(model_c, opt_c, broken, batches, delay=100_000_000)
    assert got[0] == ref[0] and got[1] != ref[1]
