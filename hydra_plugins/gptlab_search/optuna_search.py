"""hydra/sweeper=gptlab_optuna: the Hydra face of gptlab.search.sweeper.

Hydra imports every module under hydra_plugins at start-up, so this one imports nothing heavy:
gptlab and Optuna load when a search actually starts.
"""

from typing import Any, Dict, List, Optional

from hydra_plugins.gptlab_search.launching import LaunchingSweeper


class GptlabOptunaSweeper(LaunchingSweeper):
    """A Bayesian search: hydra.sweeper.params is the search space, hparams_search the settings."""

    def __init__(self, params: Optional[Dict[str, Any]] = None, seeds: Any = 1) -> None:
        super().__init__()
        self.params = dict(params or {})
        self.seeds = seeds

    def sweep(self, arguments: List[str]) -> Any:
        from gptlab.search.sweeper import Search

        search = Search(self.config, self.launcher, self.params, self.seeds)
        search.prepare(arguments)
        return search.run()
