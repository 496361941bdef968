"""Checkpoints: what one holds, how it is saved and loaded, and reading sharded DCP folders.

What one holds and how it is saved and loaded (state), and reading sharded DCP folders without
running code from them (safe_dcp).
"""

from gptlab import moved_attribute


def __getattr__(name):  # gptlab.checkpoint was one module: its names still resolve, with a warning
    return moved_attribute(__name__, "gptlab.checkpoint.state", {"state", "safe_dcp"}, name)
