#!/usr/bin/env python3
"""Profile SFT training steps of a long-context MoE model (one process per rank).

Usage::

    torchrun --nproc-per-node 8 train_sft_profile.py --config qwen3_30b_a3b_sft_profile.yaml \
        perf_tracer.enabled=true perf_tracer.profile_steps=[1] total_train_steps=2

Exit status: 0 ok, 1 the trial failed (``stats.jsonl`` ends with a ``failed`` record), 2 bad
configuration (before any process group starts). See :mod:`sftprof.trainer`.
"""
import time

STARTED_UNIX_S = time.time()  # before the imports: they are a phase of the trial's wall time (stats.jsonl)

import sys  # noqa: E402

from sftprof.trainer import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(started_unix_s=STARTED_UNIX_S))
