"""Processes and machines: who a process is, restarts after a failure, and SLURM.

Who a process is, spawning and wrapping the model (world), restarts after a failure (restarts), and
SLURM (slurm).
"""

from gptlab import moved_attribute


def __getattr__(name):  # gptlab.distributed was one module: its names still resolve, with a warning
    return moved_attribute(
        __name__, "gptlab.distributed.world", {"world", "restarts", "slurm"}, name
    )
