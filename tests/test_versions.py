"""sftprof.versions: what ``LOG_DIR/versions.json`` records (sftprof's version and commit, NCCL, the packages)."""
import platform
import subprocess
from importlib import metadata
from pathlib import Path

from sftprof import versions as v


def test_recorded_versions_name_sftprof_with_its_commit_and_nccl_as_given(tmp_path, monkeypatch):
    """``sftprof``: the installed version with this checkout's short commit (``0.1.0+g<HEAD>``, ``.dirty`` after it
    while a tracked file has uncommitted changes); ``nccl`` and ``torch_cuda`` as the trainer gives them (None: this
    CPU machine's torch). Without git, or with the package in a folder that is not the top of its own checkout (an
    installed copy inside another project's checkout), or in none, just the version."""
    root = Path(v.__file__).resolve().parents[1]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    edited = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True, check=True).stdout.strip() != ""
    version = metadata.version("sftprof")
    recorded = v.recorded_versions(None, None)
    assert list(recorded)[:5] == ["sftprof", "python", "torch", "torch_cuda", "nccl"]
    assert recorded["sftprof"] == f"{version}+g{head}" + (".dirty" if edited else "") and len(head) >= 7
    assert (recorded["python"], recorded["torch_cuda"], recorded["nccl"]) == (platform.python_version(), None, None)
    assert v.recorded_versions("13.0", "2.28.9")["nccl"] == "2.28.9"
    project = tmp_path / "project"
    git = ["git", "-C", str(project), "-c", "user.name=t", "-c", "user.email=t@t"]
    project.mkdir()
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["commit", "-q", "--allow-empty", "-m", "other project"], check=True)
    for package in (project / "lib" / "sftprof", tmp_path / "no_checkout" / "sftprof"):
        package.mkdir(parents=True)
        monkeypatch.setattr(v, "__file__", str(package / "versions.py"))
        assert v.sftprof_version() == version
    (project / "sftprof").mkdir()
    (project / "sftprof" / "versions.py").write_text("a = 1\n")
    (project / "README.md").write_text("tracked\n")
    subprocess.run(git + ["add", "sftprof", "README.md"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "sftprof in it"], check=True)
    monkeypatch.setattr(v, "__file__", str(project / "sftprof" / "versions.py"))  # the top of a checkout
    other = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert v.sftprof_version() == f"{version}+g{other}" and other != head
    (project / "notes.txt").write_text("untracked\n")  # an untracked file is no local edit of sftprof
    assert v.sftprof_version() == f"{version}+g{other}"
    (project / "README.md").write_text("edited\n")  # a tracked file edited, anywhere in the checkout
    assert v.sftprof_version() == f"{version}+g{other}.dirty"
    subprocess.run(git + ["add", "README.md"], check=True)  # staged, not committed: still a local edit
    assert v.sftprof_version() == f"{version}+g{other}.dirty"
    monkeypatch.setenv("PATH", str(tmp_path / "no_bin"))  # no git
    assert v.sftprof_version() == version
    # not installed (a checkout on PYTHONPATH): the version of sftprof's pyproject.toml beside the package
    installed = v._installed
    monkeypatch.setattr(v, "_installed", lambda name: None if name == "sftprof" else installed(name))
    assert v.sftprof_version() is None  # no pyproject.toml
    (project / "pyproject.toml").write_text('[project]\nname = "other"\nversion = "1.0"\n')
    assert v.sftprof_version() is None  # another project's
    (project / "pyproject.toml").write_text("[project\n")  # damaged
    assert v.sftprof_version() is None
    (project / "pyproject.toml").write_text('[project]\nname = "sftprof"\nversion = "9.9.9"\n')
    assert v.sftprof_version() == "9.9.9"  # no git: the version alone
    monkeypatch.undo()  # git back
    monkeypatch.setattr(v, "__file__", str(project / "sftprof" / "versions.py"))
    monkeypatch.setattr(v, "_installed", lambda name: None if name == "sftprof" else installed(name))
    assert v.sftprof_version() == f"9.9.9+g{other}.dirty"  # with the checkout's commit (README.md staged)
    monkeypatch.setattr(v, "_installed", installed)  # another copy installed: the checkout's own version wins
    assert v.sftprof_version() == f"9.9.9+g{other}.dirty"
