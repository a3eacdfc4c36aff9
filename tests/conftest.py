"""Shared pytest setup: GPU tests are marked ``gpu`` and skipped cleanly without CUDA. On a GPU machine with
Transformer Engine, torch's cuDNN is loaded before anything imports TE, as the trainer does
(:func:`sftprof.compat.setup_transformer_engine`). Every profile summary written during the tests (in this process
and in the driver and postprocess subprocesses it starts) is checked against ``sftprof/analysis/schema.py``
(``SFTPROF_STRICT_SCHEMA=1``). Each test's changes to the process environment are undone after it."""
import os

import pytest
import torch

os.environ["SFTPROF_STRICT_SCHEMA"] = "1"  # sftprof.analysis.schema.STRICT_ENV

if torch.cuda.is_available():
    from sftprof.compat import setup_transformer_engine

    setup_transformer_engine("auto")


@pytest.fixture(autouse=True)
def _environment_undone():
    """Each test leaves the process environment as it found it (a test that starts a process group in this process
    sets RANK and MASTER_PORT, which a later test's driver would inherit): GPU tests pass in any order."""
    saved = dict(os.environ)
    yield
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker); run on a GPU machine with `python -m pytest -m gpu`")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
