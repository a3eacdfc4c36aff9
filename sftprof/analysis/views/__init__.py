"""The trace views users open in Perfetto: one rank's trace split into views (split), a view too large rewritten
into time windows (windows), and all ranks merged into one timeline (merged)."""
