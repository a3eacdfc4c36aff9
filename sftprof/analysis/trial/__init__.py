"""What a trial left, read and processed per file: its inputs, its first failure, its traces and snapshots, and the
errors and warnings of its summary."""
