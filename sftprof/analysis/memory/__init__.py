"""Memory: one allocator snapshot summarised (snapshot) and plotted, where its blocks come from (categories), the
theoretical peak of a configuration (estimate), whether it fits (fit) and an out-of-memory trial's triage (oom)."""
