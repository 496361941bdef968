"""Speed and size: what a config costs before it runs (costs), the fastest default settings
(fastpath), process settings (runtime), runtime measurement (measure) and the tuning ladder."""
