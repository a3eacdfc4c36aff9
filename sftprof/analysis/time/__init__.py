"""Where a step's time goes, from one rank's trace (trace_summary: one streaming pass) and from all ranks': GPU
activity, communication wait, collectives, kernel efficiency, host time, model parts, the ranks table and a
simulated rank's projected step."""
