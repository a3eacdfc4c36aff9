"""Analysis of kernel traces and memory snapshots (postprocessing; no torch): views, summaries, compare."""
