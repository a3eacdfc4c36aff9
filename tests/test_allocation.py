"""Allocation-mode parsing, Megatron rank order and profile-rank resolution."""
import subprocess
import sys
from pathlib import Path

import pytest

from sftprof.allocation import AllocationError, Layout, parse_allocation_mode
from sftprof.ranks import RankSpecError, format_ranks, resolve_ranks

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("mode,expect", [
    ("fsdp:d2", dict(backend="fsdp", dp=2, cp=1, tp=1, pp=1, edp=2, ep=1, etp=1)),
    ("megatron:d2t2p2", dict(backend="megatron", dp=2, cp=1, tp=2, pp=2, edp=2, ep=1, etp=2)),
    ("megatron:(attn:d2c4|ffn:d1e8)", dict(backend="megatron", dp=2, cp=4, tp=1, pp=1, edp=1, ep=8, etp=1)),
    ("megatron:(attn:d1t2|ffn:d1e2)", dict(backend="megatron", dp=1, cp=1, tp=2, pp=1, edp=1, ep=2, etp=1)),
    ("megatron:(attn:d4t2|ffn:d1e8)", dict(backend="megatron", dp=4, cp=1, tp=2, pp=1, edp=1, ep=8, etp=1)),
    ("megatron:(attn:c2|ffn:e2)", dict(backend="megatron", dp=1, cp=2, tp=1, pp=1, edp=1, ep=2, etp=1)),
    ("megatron:p2", dict(backend="megatron", dp=1, cp=1, tp=1, pp=2, edp=1, ep=1, etp=1)),
])
def test_parse(mode, expect):
    assert parse_allocation_mode(mode) == Layout(**expect)


@pytest.mark.parametrize("mode,fragment", [
    ("megatron:(attn:d2c4|ffn:d1e4)", "world size dp*cp*tp*pp=8 differs from expert world size edp*ep*etp*pp=4"),
    ("deepspeed:d2", "unknown backend 'deepspeed'"),
    ("fsdp:t2", "unknown dimension 't'"),
    ("megatron:d2d2", "given twice"),
    ("megatron:d0", "must be >= 1"),
    ("megatron:(attn:d2|ffn:e2p2)", "expert pipeline size p2 differs from attention p1"),
    ("megatron:(attn:d2,ffn:e2)", "expected megatron:(attn:LAYOUT|ffn:LAYOUT)"),
    ("d2", "expected BACKEND:LAYOUT"),
])
def test_parse_errors(mode, fragment):
    with pytest.raises(AllocationError, match=None) as exc:
        parse_allocation_mode(mode)
    assert fragment in str(exc.value)


def test_a_bad_layout_names_the_letters_of_its_form_and_the_expert_form():
    """The one-layout megatron form takes no expert letters: its errors name the (attn:|ffn:) form with an example;
    each layout of that form lists its own letters."""
    expert_form = ("; expert parallelism takes the form megatron:(attn:LAYOUT|ffn:LAYOUT) with ffn letters ['d', 't', "
                   "'p', 'e'] (EDP, ETP, PP, EP), e.g. megatron:(attn:d2c4|ffn:d1e8)")
    for mode, text in (
            ("megatron:zz", "megatron layout 'zz': expected letter+size pairs such as d2t2 using letters ['d', 't', "
                            "'p', 'c']" + expert_form),
            ("megatron:d2e4", "megatron layout 'd2e4': unknown dimension 'e'; accepted letters ['d', 't', 'p', 'c']"
                              + expert_form),
            ("megatron:(attn:zz|ffn:d1e8)", "attention layout 'zz': expected letter+size pairs such as d2t2 using "
                                            "letters ['d', 't', 'p', 'c']"),
            ("megatron:(attn:d8|ffn:zz)", "expert layout 'zz': expected letter+size pairs such as d1e8 using letters "
                                          "['d', 't', 'p', 'e']"),
            ("megatron:(attn:d2|ffn:c2)", "expert layout 'c2': unknown dimension 'c'; accepted letters ['d', 't', 'p', "
                                          "'e']"),
            ("fsdp:zz", "fsdp layout 'zz': expected letter+size pairs such as d2t2 using letters ['d']")):
        with pytest.raises(AllocationError) as exc:
            parse_allocation_mode(mode)
        assert str(exc.value) == text


def test_rank_coords_megatron_order():
    # tp fastest, then cp, dp, pp (attention); etp, ep, edp, pp (experts): Megatron's tp-cp-ep-dp-pp.
    lay = parse_allocation_mode("megatron:(attn:d2c4|ffn:d1e8)")
    assert [lay.rank_coords(r)["cp"] for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [lay.rank_coords(r)["dp"] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [lay.rank_coords(r)["ep"] for r in range(8)] == list(range(8))
    lay = parse_allocation_mode("megatron:d2t2p2")
    assert lay.rank_coords(5) == {"pp": 1, "dp": 0, "cp": 0, "tp": 1, "ep": 0, "etp": 1}
    assert lay.rank_coords(7) == {"pp": 1, "dp": 1, "cp": 0, "tp": 1, "ep": 0, "etp": 1}
    with pytest.raises(AllocationError):
        lay.rank_coords(8)


def test_resolve_ranks():
    lay = parse_allocation_mode("megatron:d2t2p2")
    assert resolve_ranks(None, lay) == [0, 4]
    for alias in ("pp_rank0", "pp-rank0", "pprank0", "default"):
        assert resolve_ranks(alias, lay) == [0, 4]
    assert resolve_ranks("", lay) == list(range(8))
    assert resolve_ranks("0,2-4", lay) == [0, 2, 3, 4]
    assert resolve_ranks(" 4, 0 ,1-1", lay) == [0, 1, 4]
    with pytest.raises(RankSpecError, match="ranks 8-99 are outside the world size 8"):
        resolve_ranks("0-99", lay)
    with pytest.raises(RankSpecError, match="reversed"):
        resolve_ranks("4-2", lay)
    with pytest.raises(RankSpecError, match="not a rank or range"):
        resolve_ranks("0,,1", lay)
    assert format_ranks([0, 2, 3, 4, 7]) == "0,2-4,7"


def _cli(*args):
    return subprocess.run([sys.executable, str(ROOT / "profile_rank_utils.py"), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_profile_rank_utils_cli():
    cfg = str(ROOT / "qwen3_30b_a3b_sft_profile.yaml")
    out = _cli("--config", cfg, "actor.backend=megatron:d2t2p2")
    assert (out.returncode, out.stdout) == (0, "0,4\n")
    out = _cli("--config", cfg, "--profile-ranks", "0,2-4")
    assert (out.returncode, out.stdout) == (0, "0,2,3,4\n")
    out = _cli("--config", cfg, "--profile-ranks", "")   # empty: every rank of the world size
    assert (out.returncode, out.stdout) == (0, "0,1,2,3,4,5,6,7\n")
    for spaced in (" ", "0, 1", " 1"):  # refused as the driver refuses PROFILE_RANKS with spaces (a reviewer)
        out = _cli("--config", cfg, "--profile-ranks", spaced)
        assert (out.returncode, out.stdout) == (2, "")
        assert out.stderr == (f"sftprof: PROFILE_RANKS={spaced!r}: must be pp_rank0, empty (all ranks) or ranks and "
                              f"ranges such as 0,2-4, comma-separated without spaces ({''.join(spaced.split())})\n")
    out = _cli("--config", cfg, "--profile-ranks", "", "actor.backend=megatron:d1")
    assert (out.returncode, out.stdout) == (0, "0\n")
    for bad in ("0-99", "3-1", "junk"):
        out = _cli("--config", cfg, "--profile-ranks", bad)
        assert out.returncode == 2 and "PROFILE_RANKS" in out.stderr and out.stdout == ""
