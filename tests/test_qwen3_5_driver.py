"""The driver's plan for CONFIG=qwen3_5_35b_a3b_sft_profile.yaml: trial names from the model, and the
layouts or environments that cannot run it stop before anything is launched or written."""
import importlib.util
from importlib.machinery import ModuleSpec
from pathlib import Path
from unittest import mock

import pytest

from sftprof.compat import GATED_DELTA_NET_CP, megatron_at_least
from sftprof.launch import DriverError, plan

ROOT = Path(__file__).resolve().parents[1]
_real_find_spec = importlib.util.find_spec


def _env(tmp_path, **extra):
    return {"CONFIG": str(ROOT / "qwen3_5_35b_a3b_sft_profile.yaml"), "FILEROOT": str(tmp_path / "fileroot"),
            "RUN_ROOT": str(tmp_path / "run"), "PROFILE_STAMP": "s1", "USE_PRECISION_AWARE_OPTIMIZER": "false",
            "MAIN_GRADS_DTYPE": "float32", **extra}


def _fla(present: bool):
    def find_spec(name, *args):
        if name == "fla":
            return ModuleSpec("fla", None) if present else None
        return _real_find_spec(name, *args)
    return mock.patch("importlib.util.find_spec", find_spec)


def test_trial_names_derive_from_the_model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with _fla(True):
        trials, settings, info = plan(_env(tmp_path), [], gpus=8)
    assert [t.name for t in trials] == [f"qwen3_5_35b_a3b_fake32k_{k}_step{s}_s1"
                                        for s in (0, 1) for k in ("kernel", "memory")]
    assert info.nproc_per_node == 8
    assert any(line.startswith("# layout megatron:(attn:d4t2|ffn:d1e8)") for line in settings)
    assert not (tmp_path / "run").exists()  # plan() writes nothing


def test_without_fla_the_plan_stops_naming_the_package(tmp_path):
    with _fla(False), pytest.raises(DriverError, match=r"needs the Python package 'fla' from "
                                                       r"flash-linear-attention==0.6.0 and fla-core==0.6.0"):
        plan(_env(tmp_path), [], gpus=8)


def test_context_parallel_layout_stops_before_launch_before_megatron_core_0_18(tmp_path, monkeypatch):
    """CP > 1 for Qwen3.5 is planned from megatron-core 0.18 (gated delta-net with context parallelism) and refused
    before launch with earlier releases."""
    args = ["actor.backend=megatron:(attn:d2c4|ffn:d1e8)"]
    if megatron_at_least(GATED_DELTA_NET_CP):
        monkeypatch.chdir(tmp_path)
        with _fla(True):
            _, settings, _ = plan(_env(tmp_path), args, gpus=8)
        assert any(line.startswith("# layout megatron:(attn:d2c4|ffn:d1e8)") for line in settings)
        return
    with _fla(True), pytest.raises(DriverError, match=r"context parallelism \(CP=4\) is not supported for "
                                                      r"qwen3_5_moe_text with megatron-core 0\.1"):
        plan(_env(tmp_path), args, gpus=8)
