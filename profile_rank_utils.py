#!/usr/bin/env python3
"""Print the ranks to profile for a config: ``profile_rank_utils.py --config FILE [--profile-ranks SPEC] [key=value ...]``.

SPEC: absent -> rank 0 of every pipeline stage (``pp_rank0``); ``""`` -> every rank of the config's world size
(``actor.backend``), e.g. ``0,1,2,3,4,5,6,7``; ``0,2-4`` -> ``0,2,3,4``. SPEC is read as the driver reads
``PROFILE_RANKS`` (comma-separated without spaces); bad specs or ranks outside the world size exit 2.
"""
import argparse
import sys

from sftprof.allocation import parse_allocation_mode
from sftprof.cli import run_main
from sftprof.config import load_config_or_exit
from sftprof.launch import DriverError
from sftprof.launch.variables import RANKS_VARIABLE
from sftprof.ranks import RankSpecError, resolve_ranks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="YAML config path or bundled preset name")
    ap.add_argument("--profile-ranks", default=None, help="pp_rank0 (default) | '' (all ranks) | 0,2-4")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    args = ap.parse_args(argv)
    if args.profile_ranks is not None:
        try:  # the driver's format rules (no spaces) before the ranks are resolved
            RANKS_VARIABLE.parse(RANKS_VARIABLE.name, args.profile_ranks)
        except DriverError as err:
            print(f"sftprof: {err}", file=sys.stderr)
            return 2
    cfg = load_config_or_exit(args.config, args.overrides)
    layout = parse_allocation_mode(cfg.actor.backend)
    try:
        ranks = resolve_ranks(args.profile_ranks, layout)
    except RankSpecError as err:
        print(f"sftprof: PROFILE_RANKS={args.profile_ranks!r}: {err} (layout {cfg.actor.backend}, "
              f"{layout.world_size} ranks)", file=sys.stderr)
        return 2
    print(",".join(map(str, ranks)))
    return 0


if __name__ == "__main__":
    run_main(main)
