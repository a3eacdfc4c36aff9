"""Restricted unpickling of allocator snapshots: real snapshots load, crafted pickles are refused."""
import gzip
import os
import pickle
import subprocess
import sys
from collections import OrderedDict

import pytest

from fixtures import gpu_snapshot_fixtures
from sftprof.profiling.safe_pickle import UnsafePickleError, safe_load, safe_load_file


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


def test_builtin_containers_of_old_protocols_are_admitted():
    data = {"s": {1, 2}, "f": frozenset({3}), "o": OrderedDict(a=1), "t": (1.5, None, True, "x", 2**70)}
    for proto in (0, 2, pickle.HIGHEST_PROTOCOL):
        assert safe_load(pickle.dumps(data, protocol=proto)) == data


def test_truncated_snapshot_names_the_file(tmp_path):
    bad = tmp_path / "snap.pickle"
    bad.write_bytes(pickle.dumps({"segments": list(range(1000))})[:-20])
    with pytest.raises(ValueError, match="snap.pickle"):
        safe_load_file(bad)
