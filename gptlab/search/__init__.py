"""Hyperparameter search: an Optuna study driven by a Hydra sweeper, each trial a gptlab job.

- space.py: the search space from Optuna's Hydra syntax (interval, tag(log, ...), choice, range);
- study.py: the objective's metrics, the storage, sampler and pruner, the search a study holds
  (one record) and each trial's point (seeded by its number, never one already tried);
- trial.py: a trial's side, inside its training job (reports each evaluation, asks the pruner);
- sweeper.py: the sweeper's side (asks trials, launches them, tells the study how each ended);
- best.py: a sweep's or search's best configuration as an experiment file (gptlab.compare's
  compare.export_best), for the big run.

The Hydra plugin itself (hydra_plugins/gptlab_search) only forwards to sweeper.py. docs/search.md is
the guide.
"""
