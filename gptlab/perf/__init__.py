"""Speed and size: costs, the fastest defaults, process settings, measurement and the ladder.

What a config costs before it runs (costs), the fastest default settings (fastpath), process
settings (runtime), runtime measurement (measure) and the tuning ladder.
"""
