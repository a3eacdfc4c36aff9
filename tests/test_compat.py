"""The compatibility code of ``sftprof.compat``: the supported megatron-core releases (the refusal of others, in
``sftprof.pycheck`` too), the patches of megatron-core without TE, fla's Hopper/Triton guard."""
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from sftprof.compat import apply_megatron_compat, fla_key_block_width, narrow_fla_hopper_guard
from sftprof.config import ConfigError


ROOT = Path(__file__).resolve().parents[1]


def _with_megatron_core(tmp_path, package_info: str, code: str) -> str:
    """stdout of ``python -c code`` with a megatron-core whose ``package_info.py`` is ``package_info`` found
    first on the path (an empty package otherwise: its version is read, never imported)."""
    core = tmp_path / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "__init__.py").write_text("raise ImportError('not for importing')\n")
    (core / "package_info.py").write_text(package_info)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


_CHECK = """
from sftprof import compat, pycheck
print(pycheck.problem() or "ok")
try:
    compat.check_megatron_version()
    print("accepted", compat.megatron_core_version(), compat.megatron_at_least(compat.GATED_DELTA_NET_CP))
except compat.ConfigError as err:
    print("ConfigError:", err)
"""


@pytest.mark.parametrize("version,accepted", [((0, 16, 0), False), ((0, 16, 1), True), ((0, 19, 2), True),
                                              ((0, 20, 0), False), ((1, 0, 0), False)])
def test_megatron_core_outside_the_supported_releases_is_refused(tmp_path, version, accepted):
    """The driver's pre-flight (``sftprof.pycheck``) and the megatron settings check (``check_megatron_version``,
    before any GPU work) accept 0.16.1 to 0.19.x and refuse others naming the installed and the supported versions;
    the version is that of the ``package_info.py`` the import would run, with a pre-release suffix."""
    info = 'MAJOR = %d\nMINOR = %d\nPATCH = %d\nPRE_RELEASE = "rc1"\n' % version
    lines = _with_megatron_core(tmp_path, info, _CHECK).splitlines()
    dotted = ".".join(map(str, version))
    if accepted:
        assert lines == ["ok", f"accepted {version} {version >= (0, 18, 0)}"]
        return
    problem = (f"megatron-core {dotted} is installed; sftprof supports megatron-core>=0.16.1,<0.20 "
               "(pip install 'megatron-core>=0.16.1,<0.20')")
    assert lines == [problem, f"ConfigError: actor.backend=megatron: {problem}"]


def test_unreadable_megatron_core_version_is_named(tmp_path):
    lines = _with_megatron_core(tmp_path, "__version__ = '0.19.2'\n", _CHECK).splitlines()
    path = tmp_path / "megatron" / "core" / "package_info.py"
    problem = f"cannot read megatron-core's version from {path}: no MAJOR/MINOR/PATCH integers"
    assert lines == [problem, f"ConfigError: actor.backend=megatron: {problem}"]



@pytest.mark.parametrize("version, problem", [
    ("4.40.0", "untested versions: transformers 4.40.0 is not in <6,>=5.17 (the tested ranges are pyproject.toml's; "
               "`pip install -e <the sftprof repository> -c constraints.txt` installs the tested set)"),
    ("5.25.0", "ok")])
def test_source_copy_of_transformers_is_checked_at_the_version_it_imports(tmp_path, version, problem):
    """A ``transformers/`` directory on PYTHONPATH (no dist-info; the installed metadata says another version): the
    pre-flight checks the ``__version__`` the import would take, not the installed distribution's."""
    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers" / "__init__.py").write_text(f'__version__ = "{version}"\nraise ImportError("no")\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    out = subprocess.run([sys.executable, "-m", "sftprof.pycheck"], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert (out.returncode, out.stdout.strip()) == (0, problem), out.stderr


def test_pycheck_reads_pyproject_once(monkeypatch):
    from sftprof import pycheck

    reads = []
    real = pycheck.requirements
    monkeypatch.setattr(pycheck, "requirements", lambda: reads.append(1) or real())
    assert pycheck.problem() is None
    assert len(reads) == 1

def test_installed_megatron_core_is_read_as_imported():
    import megatron.core

    from sftprof.compat import check_megatron_version, megatron_core_version

    check_megatron_version()
    assert ".".join(map(str, megatron_core_version())) == megatron.core.__version__


def test_checkpoint_without_output_has_no_fp8_without_te():
    from megatron.core.tensor_parallel import random as mrandom

    if mrandom.HAVE_TE:  # with TE megatron-core needs no patch, and none is applied
        assert apply_megatron_compat() is False
        return
    apply_megatron_compat()
    from megatron.core.transformer.moe import moe_utils

    assert moe_utils.te_general_gemm is None  # bound by the patch before 0.17, by megatron-core itself since
    assert mrandom.CheckpointWithoutOutput().fp8 is False
    assert mrandom.CheckpointWithoutOutput(fp8=None).fp8 is False
    assert apply_megatron_compat() is False  # idempotent: nothing left to patch


_SETUP = """
import importlib.util, sys
from sftprof.compat import setup_transformer_engine
from sftprof.config import ConfigError
try:
    print(setup_transformer_engine(sys.argv[1]))
except ConfigError as err:
    print("ConfigError:", err)
    raise SystemExit(0)
print("find_spec", importlib.util.find_spec("transformer_engine"))
try:
    import transformer_engine
    print("imported")
except ModuleNotFoundError as err:
    print("ModuleNotFoundError")
from megatron.core.transformer.moe import moe_utils
print("megatron HAVE_TE", moe_utils.HAVE_TE)
"""


def _setup(mode: str) -> list[str]:
    import subprocess

    out = subprocess.run([sys.executable, "-c", _SETUP, mode], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


def test_transformer_engine_off_hides_te_from_the_process():
    lines = _setup("local")
    assert lines[0].startswith("(False, ['transformer_engine: hidden (actor.megatron.transformer_impl=local)")
    assert lines[1:] == ["find_spec None", "ModuleNotFoundError", "megatron HAVE_TE False"]


def test_transformer_engine_on_without_te_is_a_config_error():
    from sftprof.models.specs import have_transformer_engine

    if have_transformer_engine():
        pytest.skip("TE imports here: 'transformer_engine' is satisfied")
    assert _setup("transformer_engine") == [
        "ConfigError: actor.megatron.transformer_impl=transformer_engine: transformer_engine is not installed; "
        "accepted: auto or local, or install transformer-engine[pytorch]"]


@pytest.mark.parametrize("dim,hopper,bk", [(16, True, 16), (8, True, 16), (32, True, 32), (33, True, 64),
                                           (64, True, 64), (65, True, 128), (128, True, 128), (256, True, 128),
                                           (128, False, 64)])
def test_fla_key_block_width_follows_fla(dim, hopper, bk):
    assert fla_key_block_width(dim, hopper) == bk


@pytest.fixture
def fake_chunk_o(monkeypatch):
    """A stand-in for ``fla.ops.common.chunk_o`` as it is on an H200 with Triton 3.6 (only the names read)."""
    if torch.cuda.is_available():
        torch.cuda.init()  # CUDA's lazy init imports triton: not with the stand-in below
    mod = types.SimpleNamespace(IS_NVIDIA_HOPPER=True, TRITON_ABOVE_3_4_0=True, TRITON_ABOVE_3_7_1=False,
                                check_shared_mem=lambda arch, index: arch == "hopper")
    for name in ("fla", "fla.ops", "fla.ops.common"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.common.chunk_o", mod)
    sys.modules["fla.ops.common"].chunk_o = mod
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(__version__="3.6.0"))
    return mod


def test_fla_guard_lifted_for_key_block_128(fake_chunk_o):
    note = narrow_fla_hopper_guard(128)
    assert fake_chunk_o.TRITON_ABOVE_3_7_1 is True
    assert note.startswith("fla gated delta rule: lifted fla's guard against Triton 3.6.0 on Hopper")
    assert "linear_key_head_dim=128 uses key block 128" in note


def test_fla_guard_kept_for_key_block_64(fake_chunk_o):
    with pytest.raises(ConfigError, match=r"^actor.path: linear_key_head_dim=64 gives fla's gated chunk_bwd_dqkwg a "
                                          r"key block of 64, .* Triton 3.6.0 .*install triton>=3.7.1$"):
        narrow_fla_hopper_guard(64)
    assert fake_chunk_o.TRITON_ABOVE_3_7_1 is False


def test_fla_guard_untouched_off_hopper(fake_chunk_o):
    fake_chunk_o.IS_NVIDIA_HOPPER = False
    assert narrow_fla_hopper_guard(64) is None and fake_chunk_o.TRITON_ABOVE_3_7_1 is False
