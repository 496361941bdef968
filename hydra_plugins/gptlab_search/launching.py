"""What gptlab's sweepers share: the launcher Hydra configured, made at setup.

Abstract (no sweep()), so Hydra's plugin scan does not take it for a sweeper of its own.
"""

from typing import Any

from hydra.plugins.sweeper import Sweeper


class LaunchingSweeper(Sweeper):
    """A sweeper that keeps Hydra's context and config, and launches jobs on its launcher."""

    def __init__(self) -> None:
        self.config = self.launcher = self.hydra_context = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        from hydra.core.plugins import Plugins

        self.hydra_context, self.config = hydra_context, config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )
