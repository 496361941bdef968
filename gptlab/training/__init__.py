"""A training run: building it, the built run, the one loop and its profiler.

Config turned into objects (build), the built run (run), the one loop (loop) and its profiler
(profiling).
"""
