"""A training run: config turned into objects (build), the built run (run), the one loop (loop)
and its profiler (profiling)."""
