"""gptlab's SLURM launcher as a Hydra plugin (Hydra takes launchers from hydra_plugins only)."""
