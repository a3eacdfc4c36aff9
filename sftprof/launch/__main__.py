"""``python -m sftprof.launch``: see :mod:`sftprof.launch.cli`."""
from sftprof.cli import run_main
from sftprof.launch.cli import main

run_main(main)
