"""The run's records: its folder (always written) and its MLflow run (when a store answers).

- ``layout``: what a run folder holds, what counts as one, and the readers of its files;
- ``identity``: what a run is recorded as (experiment, name, tags), computed once for every command;
- ``store``: opening an MLflow store, retrying it, naming it, and the commands and URLs that show
it;
- ``parent``: a sweep's MLflow parent run, created and ended the same way live and by gptlab.sync;
- ``tracker``: rank 0's writer of a run's records during training;
- ``runfolder``: what a new start does with the folder it is given (claim, lock, resume).
"""
