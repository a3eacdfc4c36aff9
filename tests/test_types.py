"""The type checker: mypy over sftprof/analysis and sftprof/launch with pyproject.toml's [tool.mypy] (strict in every
module), so the README's test command runs it. Its cache (``.mypy_cache/``) makes a rerun take about a
second."""
from pathlib import Path

from mypy import api

ROOT = Path(__file__).resolve().parents[1]


def test_analysis_passes_mypy(monkeypatch):
    monkeypatch.chdir(ROOT)  # the configuration's files are relative to the repository
    out, err, status = api.run(["--config-file", str(ROOT / "pyproject.toml")])
    assert status == 0, out + err
    assert out.startswith("Success: no issues found in ")
