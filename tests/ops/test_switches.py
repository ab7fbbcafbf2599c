"""The ``MEGASEQ_*`` switches (``ops.switches``): read in one module, a run's config wins over the environment,
and a bad value names the variable."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from megaseq.ops import autotune, switches

SRC = Path(__file__).resolve().parents[2] / "src" / "megaseq"
READ = re.compile(r"(environ\.get\(|getenv\()\s*f?[\"']MEGASEQ_|environ\[\s*f?[\"']MEGASEQ_\w*[\"']\s*\](?!\s*=[^=])")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("MEGASEQ_AUTOTUNE", "MEGASEQ_FLA_AUTOTUNE", "MEGASEQ_CACHE_DIR", "MEGASEQ_MLA_AUTOTUNE",
                "MEGASEQ_MLA_DC", "MEGASEQ_ADAMW"):
        monkeypatch.delenv(var, raising=False)


def test_defaults():
    assert (switches.autotune_mode(), switches.mla_dc(), switches.adamw_kernel()) == ("pruned", "saved", "triton")
    assert not switches.mla_autotune() and not switches.fla_one_config()
    assert switches.cache_root() == Path("~/.cache/megaseq").expanduser()


def test_the_config_wins_over_the_environment_for_the_run(monkeypatch, tmp_path):
    monkeypatch.setenv("MEGASEQ_AUTOTUNE", "full")
    monkeypatch.setenv("MEGASEQ_CACHE_DIR", str(tmp_path / "env"))
    with switches.configured(autotune="one", cache_dir=str(tmp_path / "cfg")):
        assert autotune.mode() == "one" and autotune.cache_root() == tmp_path / "cfg"
    assert autotune.mode() == "full" and autotune.cache_root() == tmp_path / "env"
    with switches.configured():  # unset in the config: the environment
        assert autotune.mode() == "full"


def test_bad_values_name_the_setting(monkeypatch):
    monkeypatch.setenv("MEGASEQ_MLA_DC", "fast")
    with pytest.raises(ValueError, match="MEGASEQ_MLA_DC must be one of pool, saved, atomic"):
        switches.mla_dc()
    monkeypatch.setenv("MEGASEQ_ADAMW", "apex")
    with pytest.raises(ValueError, match="MEGASEQ_ADAMW must be one of triton, torch"):
        switches.adamw_kernel()
    with pytest.raises(ValueError, match="model.autotune must be one of pruned, full, one"):
        with switches.configured(autotune="fast"):
            pass


def test_a_run_applies_its_config():
    from megaseq.config import Config, ModelConfig
    from megaseq.train.trainer import kernels_for

    cfg = Config(model=ModelConfig(autotune="one", kernel_cache="/tmp/megaseq-kernels"))
    with kernels_for(cfg, torch.device("cpu")):
        assert switches.autotune_mode() == "one" and switches.cache_root() == Path("/tmp/megaseq-kernels")
    assert switches.autotune_mode() == "pruned"


def test_config_refuses_an_unknown_mode():
    from megaseq.config import ModelConfig

    with pytest.raises(ValueError, match="model.autotune must be one of pruned, full, one"):
        ModelConfig(autotune="fastest")


def _readers() -> list[str]:
    return [f"{p.relative_to(SRC)}:{n}" for p in SRC.rglob("*.py") if p.name != "switches.py"
            for n, line in enumerate(p.read_text().splitlines(), 1) if READ.search(line)]


def test_only_switches_reads_the_environment():
    assert _readers() == []


def test_a_second_reader_is_caught():
    assert READ.search('mode = os.environ.get("MEGASEQ_MLA_DC", "saved")') and READ.search('os.environ["MEGASEQ_X"]')
    assert READ.search("os.getenv('MEGASEQ_ADAMW')") and not READ.search('os.environ["MEGASEQ_AUTOTUNE"] = "full"')


def test_fast_off_leaves_ops_out_of_the_fast_set(monkeypatch):
    from megaseq.ops.kernels import preferred_kernels

    assert {"rope", "swiglu"} <= set(preferred_kernels("cuda", "fast"))
    monkeypatch.setenv("MEGASEQ_FAST_OFF", "rope, swiglu")
    got = preferred_kernels("cuda", "fast")
    assert "rope" not in got and "swiglu" not in got and "rms_norm" in got
    monkeypatch.setenv("MEGASEQ_FAST_OFF", "rope,no_such_op")
    with pytest.raises(ValueError, match="MEGASEQ_FAST_OFF names no_such_op"):
        preferred_kernels("cuda", "fast")
