"""``profile_summary.md`` and the summary files: the Markdown rendering (render, trace, memory, markdown), the
findings at its top, and the writing of ``profile_summary.{json,md}`` (summary_file)."""
