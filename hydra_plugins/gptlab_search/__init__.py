"""gptlab's Optuna sweeper as a Hydra plugin (Hydra takes sweepers from hydra_plugins only)."""
