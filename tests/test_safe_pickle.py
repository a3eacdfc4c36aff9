"""Restricted unpickling of allocator snapshots: real snapshots load, crafted pickles are refused."""
import gzip
import os
import pickle
import subprocess
import sys
from collections import OrderedDict

import pytest

from fixtures import gpu_snapshot_fixtures
from sftprof.analysis.memory.safe_pickle import UnsafePickleError, safe_load, safe_load_file


class _Evil:
    """Unpickling this with the standard unpickler runs a shell command (creates ``marker``)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("path", gpu_snapshot_fixtures(), ids=lambda p: p.name)
def test_real_snapshot_loads_identically(path):
    with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as f:
        trusted = pickle.load(f)
    assert safe_load_file(path) == trusted


def test_malicious_pickle_is_refused_without_side_effect(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "snapshot_rank0_pp0_dp0_cp0_tp0_ep0.pickle"
    evil.write_bytes(pickle.dumps({"segments": [], "device_traces": [[_Evil(marker)]]}))
    with pytest.raises(UnsafePickleError) as err:
        safe_load_file(evil)
    assert str(evil) in str(err.value) and "system" in str(err.value)
    assert not marker.exists()
    # The same bytes do run code under the standard unpickler (so the refusal above is meaningful).
    subprocess.run([sys.executable, "-c", f"import pickle; pickle.load(open({str(evil)!r}, 'rb'))"], check=True)
    assert marker.exists()


def test_real_snapshots_use_no_global():
    """What the allocator's own pickles need: no GLOBAL/STACK_GLOBAL/REDUCE/BUILD opcode at all."""
    import pickletools

    for path in gpu_snapshot_fixtures():
        ops = {op.name for op, _, _ in pickletools.genops(gzip.decompress(path.read_bytes()))}
        assert not ops & {"GLOBAL", "STACK_GLOBAL", "REDUCE", "BUILD", "NEWOBJ", "NEWOBJ_EX", "INST", "OBJ"}, path


# 34-46 byte pickles that call a builtin with a huge argument (memory amplification).
_AMPLIFIERS = {
    "bytearray": b"cbuiltins\nbytearray\n(\x8a\x08" + (2**62).to_bytes(8, "little") + b"tR.",
    "range": b"\x80\x02c__builtin__\nrange\n\x8a\x05\x00\x00\x00\x00\x01\x85R.",
    "set": b"\x80\x02c__builtin__\nset\nc__builtin__\nrange\n\x8a\x05\x00\x00\x00\x00\x01\x85R\x85R.",
    "OrderedDict": pickle.dumps(OrderedDict(a=1), protocol=2),
}


@pytest.mark.parametrize("name", sorted(_AMPLIFIERS))
def test_no_callable_is_reachable(tmp_path, name):
    path = tmp_path / f"{name}.pickle"
    path.write_bytes(_AMPLIFIERS[name])
    with pytest.raises(UnsafePickleError) as err:
        safe_load_file(path)
    module = "collections" if name == "OrderedDict" else ("__builtin__" if name in ("range", "set") else "builtins")
    assert str(err.value) == (f"{path}: refusing to unpickle global '{module}.{name}' (memory snapshots hold only "
                              "dicts, lists, tuples, str, int, float, bool and None; no callable is admitted)")


@pytest.mark.parametrize("suffix", [".pickle", ".pickle.gz"])
def test_huge_length_field_is_a_truncation_not_a_memory_error(tmp_path, suffix):
    """A real snapshot whose first FRAME claims 2**62 bytes: loading reads what exists, then stops."""
    raw = gzip.decompress(gpu_snapshot_fixtures()[0].read_bytes())
    assert raw[2:3] == b"\x95"  # FRAME after PROTO 4
    bad = raw[:3] + (2**62).to_bytes(8, "little") + raw[11:]
    path = tmp_path / f"snap{suffix}"
    path.write_bytes(gzip.compress(bad) if suffix.endswith(".gz") else bad)
    with pytest.raises(ValueError) as err:
        safe_load_file(path)
    assert str(err.value) == f"{path}: not a readable snapshot pickle (UnpicklingError: pickle data was truncated)"


def test_truncated_snapshot_names_the_file(tmp_path):
    bad = tmp_path / "snap.pickle"
    bad.write_bytes(pickle.dumps({"segments": list(range(1000))})[:-20])
    with pytest.raises(ValueError, match="snap.pickle"):
        safe_load_file(bad)
