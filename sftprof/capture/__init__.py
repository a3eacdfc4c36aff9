"""Capture inside the trainer (torch): annotated regions, the kernel profiler, the memory profiler."""
