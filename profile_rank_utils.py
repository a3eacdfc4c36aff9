#!/usr/bin/env python3
"""Print the ranks to profile for a config: ``profile_rank_utils.py --config FILE [--profile-ranks SPEC] [key=value ...]``.

SPEC: absent -> rank 0 of every pipeline stage (``pp_rank0``); ``""`` -> every rank of the config's world size
(``actor.backend``), e.g. ``0,1,2,3,4,5,6,7``; ``0,2-4`` -> ``0,2,3,4``. Bad specs or ranks outside the world
size exit 2.
"""
import argparse
import sys

from sftprof.allocation import parse_allocation_mode
from sftprof.cli import run_main
from sftprof.config import load_config_or_exit
from sftprof.ranks import RankSpecError, resolve_ranks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="YAML config path or bundled preset name")
    ap.add_argument("--profile-ranks", default=None, help="pp_rank0 (default) | '' (all ranks) | 0,2-4")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    args = ap.parse_args(argv)
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
