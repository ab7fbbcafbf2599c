"""Sharded loading of a Hugging Face checkpoint: a model (glm5-flash-tiny's first 4 layers, every kind once:
``conftest.glm5_tiny4``) built on the meta device and sharded by FSDP2 over 4 gloo ranks, then filled from
safetensors, reads only each rank's rows of every tensor (counted at ``safe_open``) and holds exactly the
one-process weights (bitwise, gathered); the FSDP export (every rank gathers, rank 0 writes) is the one-process
export, file for file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.tensor  # noqa: F401  (imported once here, not in each fork)
from safetensors.torch import load_file

from conftest import glm5_tiny4
from megaseq.models.build import build_model
from megaseq.models.hf_io import export_hf_checkpoint
from megaseq.parallel.launch import spawn_local

RANKS = 4


def _reference() -> torch.nn.Module:
    return build_model(glm5_tiny4(), dtype=torch.float32, seed=3)


def _counting_safe_open(log: list[int]):
    """``safetensors.safe_open`` whose handles count the elements they hand out (whole tensors or slices)."""
    import safetensors

    real = safetensors.safe_open

    class Slice:
        def __init__(self, sl) -> None:
            self.sl = sl

        def get_shape(self):
            return self.sl.get_shape()

        def __getitem__(self, idx):
            t = self.sl[idx]
            log.append(t.numel())
            return t

    class Handle:
        def __init__(self, *a, **kw) -> None:
            self.h = real(*a, **kw)

        def __enter__(self):
            self.f = self.h.__enter__()
            return self

        def __exit__(self, *exc):
            return self.h.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, key):
            t = self.f.get_tensor(key)
            log.append(t.numel())
            return t

        def get_slice(self, key):
            return Slice(self.f.get_slice(key))

    return Handle


def _whole_reads(dst, f, key) -> None:
    """The broken loader: reads every tensor whole, then keeps this rank's rows (right weights, 4x the reads)."""
    from megaseq.models import hf_io

    a, b = hf_io.local_rows(dst)
    dst.to_local().copy_(f.get_tensor(key)[a:b])


def _load_rank(rank: int, src: str, out: str, fsdp: str, cp: int, broken: bool = False) -> None:
    import safetensors

    from megaseq.config import MemorySettings, build_config
    from megaseq.models import hf_io
    from megaseq.models.hf_io import load_hf_checkpoint
    from megaseq.models.registry import parallelize
    from megaseq.parallel.env import DistributedEnv

    torch.set_num_threads(1)
    cfg = build_config(overrides={"parallel.dp": RANKS // cp, "parallel.cp": cp, "parallel.fsdp": fsdp,
                                  "parallel.backend": "gloo", "data.seq_len": 16, "train.device": "cpu"})
    env = DistributedEnv(cfg)
    spec = glm5_tiny4()
    model = build_model(spec, dtype=torch.float32, device="meta")
    parallelize(model, MemorySettings(), env)
    model.to_empty(device="cpu")
    read: list[int] = []
    safetensors.safe_open = _counting_safe_open(read)
    if broken:
        real = hf_io._fill
        hf_io._fill = lambda dst, f, key: (_whole_reads if hf_io._is_dtensor(dst) else real)(dst, f, key)
    load_hf_checkpoint(src, model=model, spec=spec)
    ref = _reference()
    total = sum(p.numel() for p in ref.parameters()) + sum(b.numel() for b in ref.buffers())
    shards = RANKS if fsdp == "dp_cp" else RANKS // cp
    # each rank reads its rows (and the small whole tensors: norms' 64-element vectors split unevenly, ...)
    assert total / shards * 0.9 <= sum(read) <= total / shards * 1.15, (sum(read), total / shards)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        got = p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
        assert torch.equal(got, q.detach()), n
    export_hf_checkpoint(model, spec, Path(out), max_shard_bytes=200_000)
    env.shutdown()


@pytest.mark.parametrize("fsdp, cp", [("dp", 1), ("dp_cp", 2), ("dp", 2)])
def test_each_rank_reads_only_its_rows_and_the_export_is_the_one_process_one(tmp_path, fsdp, cp):
    src = export_hf_checkpoint(_reference(), glm5_tiny4(), tmp_path / "src", max_shard_bytes=200_000)
    spawn_local(_load_rank, RANKS, args=(str(src), str(tmp_path / "out"), fsdp, cp))
    files = sorted(p.name for p in src.iterdir())
    assert files == sorted(p.name for p in (tmp_path / "out").iterdir())
    for name in files:
        if name.endswith(".safetensors"):
            a, b = load_file(src / name), load_file(tmp_path / "out" / name)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
        else:
            assert (src / name).read_text() == (tmp_path / "out" / name).read_text(), name


def test_a_loader_reading_whole_tensors_is_caught(tmp_path):
    src = export_hf_checkpoint(_reference(), glm5_tiny4(), tmp_path / "src", max_shard_bytes=200_000)
    with pytest.raises(Exception, match="assert .* <= sum\\(read\\) <="):
        spawn_local(_load_rank, RANKS, args=(str(src), str(tmp_path / "out"), "dp", 1, True))


def _nonfinite_rank(rank: int, src: str, out: str) -> None:
    """A NaN in one element of the last rank's shard: the export and a checkpoint are refused on every rank."""
    from megaseq.config import MemorySettings, build_config
    from megaseq.models.hf_io import load_hf_checkpoint
    from megaseq.models.registry import parallelize
    from megaseq.parallel.env import DistributedEnv
    from megaseq.train import checkpoint as ckpt
    from megaseq.train import safe_checkpoint

    torch.set_num_threads(1)
    cfg = build_config(overrides={"parallel.dp": RANKS, "parallel.fsdp": "dp", "parallel.backend": "gloo",
                                  "data.seq_len": 16, "train.device": "cpu"})
    env = DistributedEnv(cfg)
    spec = glm5_tiny4()
    model = build_model(spec, dtype=torch.float32, device="meta")
    parallelize(model, MemorySettings(), env)
    model.to_empty(device="cpu")
    load_hf_checkpoint(src, model=model, spec=spec)
    if rank == RANKS - 1:
        p = next(p for p in model.parameters() if hasattr(p, "to_local") and p.to_local().numel())
        with torch.no_grad():
            p.to_local().view(-1)[0] = float("nan")
    # only the last rank's own shard is non-finite: without the ranks agreeing, ranks 0-2 would go on
    assert (rank == RANKS - 1) == any(not torch.isfinite(p.to_local()).all() for p in model.parameters()
                                      if hasattr(p, "to_local"))
    with pytest.raises(ValueError, match="NaN or infinite"):
        export_hf_checkpoint(model, spec, Path(out) / "hf", max_shard_bytes=200_000)
    with pytest.raises(safe_checkpoint.NonFiniteWeights):
        ckpt.save_checkpoint(Path(out), 1, model, None, None, {}, keep=2)
    env.shutdown()


def test_a_nonfinite_shard_on_one_rank_stops_the_export_and_the_checkpoint_on_every_rank(tmp_path):
    src = export_hf_checkpoint(_reference(), glm5_tiny4(), tmp_path / "src", max_shard_bytes=200_000)
    spawn_local(_nonfinite_rank, RANKS, args=(str(src), str(tmp_path / "out")))
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*")), "something was written"
