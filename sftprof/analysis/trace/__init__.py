"""Reading and checking traces: streaming Chrome-trace JSON (io), the Trace Event Format rules (check), the
soundness of a recorded step (sanity), interval arithmetic, kernel and op names, and the CPU ops of one trace."""
