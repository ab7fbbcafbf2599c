"""Page-locked host memory (``memory.host_memory``): the arena the plan's pinned bytes are locked in ahead of the
first step hands out exact aligned ranges, takes them back merged, and is unlocked once, after the run drops it and
the last range is back; a pool that does not fit locks its own. On the CPU the locking calls are recorded fakes;
on a GPU the real pools of a run with SCO and host-kept attention take all their bytes from the planned reserve."""

from __future__ import annotations

import gc

import pytest
import torch

from megaseq.memory import host_memory as hm
from megaseq.memory.rules import SLOT_ALIGN


@pytest.fixture
def locks(monkeypatch):
    """Fake page-locking on the CPU: ``locks.calls`` records (register or unregister, address, bytes)."""

    class Locks:
        calls: list[tuple[str, int, int]] = []
        fail_next = False

    def register(ptr, nbytes):
        Locks.calls.append(("lock", ptr, nbytes))
        if Locks.fail_next:
            Locks.fail_next = False
            return False
        return True

    monkeypatch.setattr(hm, "_register", register)
    monkeypatch.setattr(hm, "_unregister", lambda ptr: Locks.calls.append(("unlock", ptr, 0)))
    monkeypatch.setattr(hm, "STATS", hm.ArenaStats())
    monkeypatch.setattr(hm, "_RESERVE", None)
    Locks.calls = []
    return Locks


def _arena(nbytes: int) -> hm.PinnedArena:
    arena = hm.PinnedArena(nbytes, torch.device("cpu")).start()
    hm._RESERVE = arena
    return arena


def test_ranges_first_fit_aligned_and_merged_back(locks):
    arena = _arena(10 * SLOT_ALIGN)
    a = hm.HostBuffer(3 * SLOT_ALIGN - 7, pin=True)  # rounded up to the alignment
    b = hm.HostBuffer(2 * SLOT_ALIGN, pin=True)
    c = hm.HostBuffer(5 * SLOT_ALIGN, pin=True)
    assert [x.from_reserve and x.pinned for x in (a, b, c)] == [True] * 3
    assert [x._offset for x in (a, b, c)] == [0, 3 * SLOT_ALIGN, 5 * SLOT_ALIGN]
    assert arena.free_bytes() == 0 and a.nbytes == 3 * SLOT_ALIGN - 7
    b.release()
    d = hm.HostBuffer(SLOT_ALIGN, pin=True)  # first fit: b's place
    assert d.from_reserve and d._offset == 3 * SLOT_ALIGN
    for x in (a, c, d):
        x.release()
    assert arena.free == [(0, 10 * SLOT_ALIGN)]  # every range back, merged into one
    assert [k for k, _, _ in locks.calls] == ["lock"]  # the arena's, once: no buffer locked its own


def test_buffers_are_views_of_the_arena(locks):
    arena = _arena(4 * SLOT_ALIGN)
    buf = hm.HostBuffer(2 * SLOT_ALIGN, pin=True)
    other = hm.HostBuffer(2 * SLOT_ALIGN, pin=True)
    v = other.view(0, (SLOT_ALIGN // 4,), torch.float32)
    v.fill_(3.0)
    assert arena.base[2 * SLOT_ALIGN:3 * SLOT_ALIGN].view(torch.float32).eq(3.0).all()
    assert buf.base.data_ptr() == arena.base.data_ptr()


def test_a_pool_without_room_locks_its_own(locks):
    _arena(2 * SLOT_ALIGN)
    inside = hm.HostBuffer(2 * SLOT_ALIGN, pin=True)
    outside = hm.HostBuffer(SLOT_ALIGN, pin=True)
    assert inside.from_reserve and not outside.from_reserve and outside.pinned
    assert locks.calls[-1] == ("lock", outside.base.data_ptr(), SLOT_ALIGN)
    assert hm.STATS.taken == 2 * SLOT_ALIGN and hm.STATS.own == SLOT_ALIGN
    outside.release()
    assert locks.calls[-1] == ("unlock", locks.calls[-2][1], 0)
    outside.release()  # once
    assert sum(k == "unlock" for k, _, _ in locks.calls) == 1


def test_a_pool_made_every_step_reuses_the_arena(locks):
    """As the segments' K/V: buffers made in a step and released after it take the same bytes every step."""
    _arena(6 * SLOT_ALIGN)
    offsets = []
    for _ in range(3):
        bufs = [hm.HostBuffer(n, pin=True) for n in (SLOT_ALIGN, 2 * SLOT_ALIGN + 1, 2 * SLOT_ALIGN)]
        offsets.append([b._offset for b in bufs])
        assert all(b.from_reserve for b in bufs)
        for b in bufs:
            b.release()
    assert offsets[0] == offsets[1] == offsets[2] and hm.STATS.own == 0
    assert [k for k, _, _ in locks.calls] == ["lock"]


def test_unlocked_once_after_the_run_drops_it_and_the_last_range_is_back(locks):
    arena = _arena(2 * SLOT_ALIGN).wait()
    ptr = arena.base.data_ptr()
    buf = hm.HostBuffer(SLOT_ALIGN, pin=True)
    hm.drop_reserve()
    assert hm.current_reserve() is None
    del arena
    gc.collect()
    assert ("unlock", ptr, 0) not in locks.calls  # a range is still out
    late = hm.HostBuffer(SLOT_ALIGN, pin=True)  # the run's reserve is gone: its own
    assert not late.from_reserve and late.pinned
    buf.release()
    del buf
    gc.collect()
    assert locks.calls.count(("unlock", ptr, 0)) == 1


def test_a_failed_lock_leaves_every_pool_its_own(locks):
    locks.fail_next = True  # the arena's lock fails (a memlock limit)
    arena = _arena(4 * SLOT_ALIGN)
    buf = hm.HostBuffer(SLOT_ALIGN, pin=True)
    assert not arena.locked and hm.STATS.reserved == 0
    assert not buf.from_reserve and buf.pinned and hm.STATS.own == SLOT_ALIGN


def test_a_lock_that_raises_is_said_and_leaves_every_pool_its_own(locks, monkeypatch, caplog):
    def boom(ptr, nbytes):
        raise RuntimeError("no context")

    monkeypatch.setattr(hm, "_register", boom)
    with caplog.at_level("WARNING", logger="megaseq"):
        arena = _arena(4 * SLOT_ALIGN).wait()
    assert isinstance(arena.error, RuntimeError) and not arena.locked
    assert "page-locking" in caplog.text and "no context" in caplog.text
    monkeypatch.setattr(hm, "_register", lambda ptr, nbytes: True)
    buf = hm.HostBuffer(SLOT_ALIGN, pin=True)
    assert not buf.from_reserve and buf.pinned


def test_unpinned_buffers_and_cpu_runs_never_touch_it(locks):
    arena = _arena(4 * SLOT_ALIGN)
    plain = hm.HostBuffer(SLOT_ALIGN, pin=False)  # a CPU run's pools
    assert not plain.from_reserve and not plain.pinned and arena.free_bytes() == 4 * SLOT_ALIGN
    assert hm.reserve(1 << 20, torch.device("cpu")) is None and hm.current_reserve() is None
    assert [k for k, _, _ in locks.calls] == ["lock"]  # the arena made above, nothing since


def test_the_log_line_says_what_was_locked_ahead_and_by_the_pools():
    assert hm.summary_line(hm.ArenaStats()) is None  # a run that pins nothing (a CPU run) says nothing
    gib = 1 << 30
    line = hm.summary_line(hm.ArenaStats(reserved=18 * gib, lock_s=2.4, taken=18 * gib))
    assert line == ("pinned host memory: 18.0 GiB locked ahead of the first step in 2.4 s, 18.0 GiB of it taken by "
                    "the memory schemes' host pools")
    line = hm.summary_line(hm.ArenaStats(own=gib // 2))
    assert line == "pinned host memory: none locked ahead; 0.5 GiB locked by the pools themselves"


def test_the_reserve_is_the_plans_pinned_host_terms():
    """The plan's ``pinned_host`` is its host lines but the process's: what the pools lock (each pool's bytes are
    the runtime's: ``test_plan_kept_attention``, ``test_plan_segment_kv_host``, ``test_memory_offload_adam``)."""
    from megaseq.config import load_config
    from megaseq.plan.phases import PROCESS_HOST
    from megaseq.plan.planner import plan_from_config

    plan = plan_from_config(load_config("recipes/qwen3-30b-a3b-lora.yaml", ["data.seq_len=32768"]),
                            world_size=1, gpu_bytes=85_000_000_000)
    host = {name[len("host: "):]: b for name, _, b, _ in plan.components if name.startswith("host: ")}
    assert PROCESS_HOST in host and len(host) > 1, host  # the recipe at 32K on an 80 GB GPU pins host memory
    assert plan.pinned_host == sum(host.values()) - host[PROCESS_HOST] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_run_s_pools_take_the_planned_reserve_on_gpu():
    """A tiny Qwen3-MoE on CUDA with SCO and host-kept attention: with the planned pinned bytes reserved ahead, its
    pools take from the reserve what they lock without it and lock nothing of their own, the loss and gradients are
    those of the same step without the reserve, and every range is back once the run releases its pools."""
    from megaseq.config import MemorySettings
    from megaseq.memory.apply import loss_fn
    from megaseq.models.build import build_model
    from megaseq.models.presets import get_preset
    from megaseq.models.registry import parallelize
    from megaseq.plan.given import run_for
    from megaseq.plan.phases import evaluate, pinned_host_bytes

    spec = get_preset("qwen3-moe-tiny").replace(head_dim=64)
    L, B, S = spec.num_layers, 1, 296
    settings = dict(recompute=True, keep_attention_layers=L, keep_attention_host_layers=L - 1,
                    checkpoint_offload=True, offload_host_budget=1 << 30)
    run = run_for(spec, S, settings, batch_size=B, model_dtype="fp32")
    planned = pinned_host_bytes(evaluate(run).host_per_gpu)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec.vocab_size, (B, S), generator=gen).cuda()
    labels = torch.randint(0, spec.vocab_size, (B, S), generator=gen).cuda()
    results = []
    hm.drop_reserve()
    for ahead in (False, True):
        model = build_model(spec, dtype=torch.float32, seed=0).cuda()
        arena = hm.reserve(planned, torch.device("cuda")) if ahead else None
        done = parallelize(model, MemorySettings(**settings))
        hm.STATS.own = hm.STATS.taken = 0
        loss = loss_fn(MemorySettings())(model(ids), model.lm_head.weight, labels)
        loss.backward()
        torch.cuda.synchronize()
        pools = (done.offloader.pool, done.kept_host.pool)
        assert all(p is not None and p.pinned and p.from_reserve == ahead for p in pools)
        results.append((loss.item(), {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None},
                        hm.STATS.own, hm.STATS.taken))
        done.release()
        if ahead:
            assert arena.locked and arena.free_bytes() == arena.nbytes
            hm.drop_reserve()
    (loss0, grads0, own0, _), (loss1, grads1, own1, taken1) = results
    assert own0 > 0 and own1 == 0 and taken1 == own0 <= planned, (own0, own1, taken1, planned)
    assert loss0 == loss1
    for n in grads0:
        torch.testing.assert_close(grads1[n], grads0[n], rtol=0, atol=0, msg=n)
