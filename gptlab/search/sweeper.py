"""The sweeper's side of a search: trials asked of the study, launched, and told back.

It asks the study for trials, launches each as a gptlab job, and tells the study how it ended.

- Up to hparams_search.n_jobs trials run at once on a submitit launcher (SLURM), each its own job
  (hardware.nodes x nproc_per_node tasks, like any gptlab job), a new one starting as soon as one
  ends; Hydra's basic launcher runs them one after another in this process.
- A trial's folder is <search folder>/<trial number>; its objective is read from its results.json.
  With hydra.sweeper.seeds=k, a trial is k jobs, one per seed (train.seed, train.seed+1, ...), in
  <trial number>/seed_<seed>/, launched together; its objective is their mean, and it is not
  pruned (a pruner would judge one seed's curve).
- Each trial's point is drawn with the seed mixed with its number and is never one the study has
  tried (study.sample_point), so sweepers sharing a study draw different points. A warmup range
  reaching past the trials' train.max_steps is cut there.
- A trial that fails (diverges, crashes, is killed) is told FAIL with one line saying why; the
  search stops once more than max_failure_rate x n_trials have failed. A trial its job reports as
  pruned is told PRUNED.
- The sweeper records itself as each trial's owner and keeps a heartbeat in the study. Started again
  after it died, it finds its trials still RUNNING with a dead owner, cancels their SLURM jobs if
  any still run, and launches them again in their folders: they resume from their checkpoints under
  the same trial number, so no trial runs twice and the study ends at n_trials.
- The sweep's MLflow parent run (gptlab/search/callbacks.py) gets the search space, and as trials
  end the best value, trial and params; each trial's run gets its number, state and objective.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from omegaconf import DictConfig, OmegaConf

from gptlab.errors import GptlabError, never_fatal
from gptlab.records import layout
from gptlab.records.store import error_text
from gptlab.search import space as spaces
from gptlab.search import study as studies

log = logging.getLogger("gptlab.search")

HEARTBEAT_S = 10.0  # how often a sweeper marks itself alive in the study
STALE_S = 60.0  # a sweeper silent this long (on another host) is taken for dead
DEFINITION_WAIT_S = 10.0  # how long a study's search is waited for before this one is written
BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"


def owner_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def owner_alive(owner: Optional[str], beats: Dict[str, Any], now: float) -> bool:
    """Whether the sweeper `owner` (host:pid) still runs.

    A process check on this host, else its heartbeat's age.
    """
    if not owner:
        return False
    host, _, pid = owner.rpartition(":")
    if host == socket.gethostname() and pid.isdigit():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    beat = beats.get(f"{studies.OWNER_ATTR}:{owner}")
    return isinstance(beat, (int, float)) and now - beat < STALE_S


def trial_alive(t: Any, beats: Dict[str, Any], now: float) -> bool:
    """Whether a RUNNING trial's sweeper still runs.

    A trial another sweeper is asking for at this moment has no owner yet: it is alive until it is
    as old as a stale heartbeat.
    """
    owner = t.system_attrs.get(studies.OWNER_ATTR)
    if owner:
        return owner_alive(owner, beats, now)
    started = t.datetime_start.timestamp() if t.datetime_start else 0.0
    return now - started < STALE_S


def fill_params(study: Any, t: Any, space: Dict[str, Any], hs: Any) -> None:
    """Sample the parameters an adopted trial lacks, so every trial that runs has the whole space.

    An adopted trial lacks some when its sweeper died between asking for it and sampling it.
    """
    if any(k not in t.params for k in space):
        studies.set_point(study, study._storage, t._trial_id, space, hs)


def check_keys(cfg: DictConfig, space: Dict[str, Any]) -> None:
    """Every key of the search space must be a key of the job's config (one line naming it)."""
    from gptlab import cli

    missing = [
        k for k in space if OmegaConf.select(cfg, k.lstrip("+~"), default=_MISSING) is _MISSING
    ]
    if not missing:
        return
    key = missing[0]
    keys = cli._leaves(OmegaConf.to_container(cfg, resolve=False))
    near = cli.nearest_keys(key, keys, {})
    hint = f"; did you mean {' or '.join(near)}?" if near else ""
    raise GptlabError(f"search space: {key} is not a key of the training config{hint}")


_MISSING = object()


class Search:
    """One sweeper process's part of a study."""

    def __init__(
        self, config: DictConfig, launcher: Any, params: Dict[str, Any], seeds: Any = 1
    ) -> None:
        self.config, self.launcher, self.params = config, launcher, params
        self.seeds = seeds
        self.hs = config.hparams_search
        self.sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
        self.owner = owner_id()
        self.stop_beating = threading.Event()

    # --- set-up: everything that can be wrong is said before the first trial starts
    def prepare(self, arguments: Sequence[str]) -> None:
        hs = self.hs
        every = OmegaConf.select(self.config, "eval.hellaswag.every", default=0)
        self.direction = studies.check_settings(hs, every)
        self.space, fixed = spaces.parse(self.params, arguments)
        if not self.space:
            raise GptlabError(
                "the search space is empty: hydra.sweeper.params (an hparams_search file) or a "
                "sweep on the command line names what to search"
            )
        check_keys(self.config, self.space)
        self.seed_values = self._seed_values(fixed)
        self.notes = [n for n in [self._cap_warmup()] if n]
        # the trial's own settings are the sweeper's to give
        own = ("hparams_search.trial=", "hparams_search.attempt=")
        self.fixed = [o for o in fixed if not o.lstrip("+~").startswith(own)]
        self.url = studies.storage_url(hs.storage, str(self.config.paths.outputs))
        self.storage = studies.open_storage(self.url)
        self.study = self._study()
        self.allowed_failures = studies.allowed_failures(hs)

    def _seed_values(self, fixed: List[str]) -> List[int]:
        """The seeds each trial trains (hydra.sweeper.seeds of them, from the job's train.seed)."""
        k = self.seeds
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise GptlabError(
                f"hydra.sweeper.seeds={k}: the number of seeds each trial trains, a whole number "
                f">= 1"
            )
        if k > 1 and "train.seed" in self.space:
            raise GptlabError(
                "hydra.sweeper.seeds and a search over train.seed do not go together: the seeds "
                "are each trial's replicates, not a parameter"
            )
        given = [o.split("=", 1)[1] for o in fixed if o.startswith("train.seed=")]
        base = given[-1] if given else OmegaConf.select(self.config, "train.seed", default=0)
        try:
            base = int(base)
        except (TypeError, ValueError):
            raise GptlabError(f"train.seed={base}: a whole number") from None
        return [base + i for i in range(k)]

    def _cap_warmup(self) -> Optional[str]:
        """Cut a warmup range reaching past the trials' max_steps there (the note returned).

        A range wholly past it is refused.
        """
        steps_dist = self.space.get("train.max_steps")
        steps = spaces.lowest(steps_dist) if steps_dist is not None else None
        if steps is None:
            steps = OmegaConf.select(self.config, "train.max_steps", default=None)
        if not isinstance(steps, int):
            return None
        why = f"train.max_steps={steps}" + (" at the least" if steps_dist is not None else "")
        return spaces.cap(self.space, "optimizer.warmup_steps", steps, why)

    def _study(self) -> Any:
        """The study, made with this search's definition, or an existing one holding that search.

        Anything else is refused in one line.
        """
        import optuna

        hs = self.hs
        ours = {
            "space": {k: spaces.describe(d) for k, d in self.space.items()},
            "fixed": sorted(self.fixed),
            "metric": hs.metric,
        }
        if len(self.seed_values) > 1:  # a study of one seed per trial is not continued with three
            ours["seeds"] = self.seed_values
        made = dict(
            study_name=str(hs.study_name),
            storage=self.storage,
            sampler=studies.make_sampler(hs.sampler, hs.seed, hs.n_trials),
            pruner=studies.make_pruner(hs),
        )
        try:
            study, loaded = optuna.create_study(direction=self.direction, **made), False
        except optuna.exceptions.DuplicatedStudyError:
            study, loaded = optuna.load_study(**made), True
        sid = self.study_id = self.storage.get_study_id_from_name(str(hs.study_name))
        if not loaded:  # this sweeper made it: its search, in one write
            self.storage.set_study_system_attr(sid, studies.DEFINITION_ATTR, ours)
            return study
        if study.direction.name.lower() != self.direction:
            raise GptlabError(
                f"study {hs.study_name!r} in {studies.redact(self.url)} was made to "
                f"{study.direction.name.lower()}, not {self.direction}: choose another "
                f"hparams_search.study_name"
            )
        held = self._held_search(sid, ours)
        for part in dict.fromkeys([*ours, *(["seeds"] if "seeds" in held else [])]):
            value = ours.get(part)
            if held.get(part) != value:
                what = {
                    "fixed": "set of fixed overrides",
                    "seeds": "set of seeds per trial (hydra.sweeper.seeds)",
                }.get(part, part)
                raise GptlabError(
                    f"study {hs.study_name!r} in {studies.redact(self.url)} holds a search with "
                    f"another {what} (the study's: {held.get(part)}; here: {value}); the same "
                    f"command continues a study, another needs its own hparams_search.study_name"
                )
        return study

    def _held_search(self, study_id: int, ours: Dict[str, Any]) -> Dict[str, Any]:
        """The search an existing study holds.

        Its maker writes it just after making the study: a study without one is waited for a while,
        then given `ours` (made by hand, or its maker died between the two).
        """
        deadline = time.monotonic() + DEFINITION_WAIT_S
        while True:
            held = studies.definition(self.storage.get_study_system_attrs(study_id))
            if held is not None:
                return held
            if time.monotonic() > deadline:
                self.storage.set_study_system_attr(study_id, studies.DEFINITION_ATTR, ours)
                return ours
            time.sleep(0.2)

    # --- the search
    def run(self) -> List[Any]:
        import optuna

        hs = self.hs
        beat = threading.Thread(target=self._beat, daemon=True)
        self._heartbeat()
        beat.start()
        self.parent = self._read_parent()
        self._record_space()
        launcher = type(self.launcher)
        self.basic = f"{launcher.__module__}.{launcher.__name__}" == BASIC_LAUNCHER
        n_jobs = 1 if self.basic else int(hs.n_jobs)
        self._say_plan(n_jobs)
        returns: List[Any] = []
        pool = cf.ThreadPoolExecutor(max_workers=n_jobs) if not self.basic else None
        running: Dict[Any, int] = {}
        try:
            while True:
                self._check_failures()
                for number in self._next_trials(n_jobs - len(running), set(running.values())):
                    jobs = self._jobs(number)
                    if pool is None:
                        returns.append(self._finish(number, self._launch(number, jobs)))
                        break
                    running[pool.submit(self._launch, number, jobs)] = number
                if pool is None:
                    if not self._more_to_do(set()):
                        break
                    continue
                if not running:
                    if self._others_running():
                        time.sleep(HEARTBEAT_S)  # another sweeper's trials: wait for the count
                        continue
                    break
                finished, _ = cf.wait(list(running), return_when=cf.FIRST_COMPLETED)
                for future in finished:
                    returns.append(self._finish(running.pop(future), future))
        finally:
            if pool is not None:
                pool.shutdown(wait=True)
            self.stop_beating.set()
        self._summary(optuna)
        return returns

    def _say_plan(self, n_jobs: int) -> None:
        """The search's first line: what runs, as it will run."""
        hs = self.hs
        done = [t for t in self.study.get_trials(deepcopy=False) if t.state.is_finished()]
        at_once = f"{n_jobs} at a time"
        if self.basic and hs.n_jobs > 1:
            at_once += (
                f" (hparams_search.n_jobs={hs.n_jobs} needs another launcher, "
                f"hydra/launcher=slurm_* or local)"
            )
        log.info(
            f"search {hs.study_name!r}: {hs.n_trials} trials ({len(done)} done), {at_once}, "
            f"{self.direction} {hs.metric}{self._seeds_text()}; study in "
            f"{studies.redact(self.url)}; trials in "
            f"{self.sweep_dir}/<trial>"
        )
        for note in self.notes:
            log.info(note)

    def _seeds_text(self) -> str:
        seeds = self.seed_values
        if len(seeds) == 1:
            return ""
        return f" (the mean of {len(seeds)} seeds, {seeds[0]}..{seeds[-1]}, per trial; no pruning)"

    def trials(self) -> List[Any]:
        """The study's trials, without those asked one too many in a race between sweepers."""
        trials = self.study.get_trials(deepcopy=False)
        return [t for t in trials if not t.system_attrs.get(studies.SURPLUS_ATTR)]

    def _more_to_do(self, ours: set) -> bool:
        trials = self.study.get_trials(deepcopy=False)
        return len(trials) < self.hs.n_trials or bool(self._orphans(trials, ours))

    def _running(self, trials: List[Any]) -> List[Any]:
        """The RUNNING trials, each with whether its sweeper is alive: (trial, alive)."""
        from optuna.trial import TrialState

        beats = self.storage.get_study_system_attrs(self.study_id)
        now = time.time()
        return [(t, trial_alive(t, beats, now)) for t in trials if t.state == TrialState.RUNNING]

    def _others_running(self) -> bool:
        return any(alive for _, alive in self._running(self.study.get_trials(deepcopy=False)))

    def _orphans(self, trials: List[Any], ours: set) -> List[Any]:
        return [t for t, alive in self._running(trials) if not alive and t.number not in ours]

    def _next_trials(self, slots: int, ours: set) -> List[int]:
        """Up to `slots` trial numbers to launch: a dead sweeper's trials first, then new ones."""
        from optuna.trial import TrialState

        numbers: List[int] = []
        trials = self.study.get_trials(deepcopy=False)
        for t in self._orphans(trials, ours)[:slots]:
            self._adopt(t)
            numbers.append(t.number)
        total = len(trials)
        while len(numbers) < slots and total < self.hs.n_trials:
            trial = self.study.ask()  # a number of its own; its point is drawn below
            if trial.number >= self.hs.n_trials:
                # another sweeper on this study asked at the same moment: one too many, never run
                self.storage.set_trial_system_attr(trial._trial_id, studies.SURPLUS_ATTR, True)
                self.study.tell(trial.number, state=TrialState.FAIL)
                break
            self.storage.set_trial_system_attr(trial._trial_id, studies.OWNER_ATTR, self.owner)
            studies.set_point(self.study, self.storage, trial._trial_id, self.space, self.hs)
            numbers.append(trial.number)
            total += 1
        return numbers

    def _adopt(self, t: Any) -> None:
        """Take over a dead sweeper's RUNNING trial.

        Its SLURM job (if it still runs) is cancelled and waited for, so the trial's folder is free
        for the job that resumes it.

        The attempt is raised before the job id is read: a job of the dead sweeper that was still
        queued records its id and then reads the attempt when it starts (gptlab/search/trial.py),
        so it is either cancelled here or finds itself superseded and ends without touching the
        folder."""
        self.storage.set_trial_system_attr(t._trial_id, studies.OWNER_ATTR, self.owner)
        attempt = int(t.system_attrs.get(studies.ATTEMPT_ATTR, 0)) + 1
        self.storage.set_trial_system_attr(t._trial_id, studies.ATTEMPT_ATTR, attempt)
        job = self.storage.get_trial(t._trial_id).system_attrs.get(studies.SLURM_ATTR)
        log.info(
            f"trial {t.number}: its sweeper is gone; resuming it"
            + (f" (cancelling its SLURM job {job} first)" if job else "")
        )
        if job:
            cancel_and_wait(str(job))
        self._drop_unsaved_attempt(t.number)
        fill_params(self.study, t, self.space, self.hs)

    def _drop_unsaved_attempt(self, number: int) -> None:
        """Delete the MLflow run begun for a taken-over trial that has no checkpoint.

        Such a trial starts afresh (its folder's records moved aside): the MLflow run its cancelled
        job had begun holds nothing to continue, and is deleted, so the trial stays one child of the
        search (MLflow keeps deleted runs restorable).
        """
        from gptlab.checkpoint import state as checkpoint

        folders = self.folders(number)
        if not self.parent or any(checkpoint.latest(f / layout.CHECKPOINTS) for f in folders):
            return
        # the trial goes on; at worst it has two runs
        with never_fatal(
            lambda e: log.warning(
                f"trial {number}: could not delete its unfinished MLflow run: {e}"
            )
        ):
            for run_id in self._runs_of(number):
                self._client().delete_run(run_id)
                log.info(f"trial {number}: no checkpoint; its unfinished MLflow run is deleted")

    def folders(self, number: int) -> List[Path]:
        """Trial `number`'s job folders: its own, or one per seed."""
        folder = self.sweep_dir / str(number)
        if len(self.seed_values) == 1:
            return [folder]
        return [folder / f"seed_{seed}" for seed in self.seed_values]

    def _jobs(self, number: int) -> List[List[str]]:
        """The overrides of trial `number`'s jobs: one, or one per seed, each in its own folder."""
        overrides = self._overrides(number)
        if len(self.seed_values) == 1:
            return [overrides]
        common = [o for o in overrides if not o.startswith("train.seed=")]
        return [
            [
                *common,
                f"train.seed={seed}",
                "hparams_search.pruner=none",
                f"hydra.sweep.subdir={number}/seed_{seed}",
            ]
            for seed in self.seed_values
        ]

    def _overrides(self, number: int) -> List[str]:
        trial = self.study.get_trials(deepcopy=False)[number]
        sampled = [spaces.override(k, trial.params[k]) for k in self.space]
        url = self.url.replace("'", "\\'")
        return [
            *self.fixed,
            *sampled,
            f"hparams_search.trial={number}",
            f"hparams_search.attempt={trial.system_attrs.get(studies.ATTEMPT_ATTR, 0)}",
            f"hparams_search.storage='{url}'",
        ]

    def _launch(self, number: int, jobs: List[List[str]]) -> Any:
        """Run one trial's jobs, blocking until they end; their JobReturns, or the exception.

        One JobReturn per job (one: itself).
        """
        try:
            returns = self.launcher.launch(jobs, initial_job_idx=number * len(jobs))
            return returns[0] if len(jobs) == 1 else list(returns)
        except Exception as e:  # noqa: BLE001 - a job that died: its outcome, not the search's
            return e

    def _finish(self, number: int, outcome: Any) -> Any:
        """Tell the study how trial `number` ended; one line on the console; MLflow's records."""
        if isinstance(outcome, cf.Future):
            outcome = outcome.result()
        folders = self.folders(number)
        each = outcome if isinstance(outcome, list) else [outcome] * len(folders)
        judged = [self._judge(f, o) for f, o in zip(folders, each)]
        state, value, why, results = judged[0]
        if len(judged) > 1:
            state, value, why = self._mean_of_seeds(judged)
        trial = self.study.get_trials(deepcopy=False)[number]
        if trial.state.is_finished():
            log.info(f"trial {number}: already ended ({trial.state.name}) elsewhere")
            return outcome
        if why:
            self.storage.set_trial_system_attr(trial._trial_id, studies.ERROR_ATTR, why[:2000])
        if len(judged) > 1:
            values = [v for _, v, _, _ in judged]
            self.storage.set_trial_user_attr(trial._trial_id, "seed_values", values)
        self.study.tell(number, value, state=state)
        all_results = [r for _, _, _, r in judged]
        self._record_trial(number, trial.params, state.name, value, all_results, why)
        self._say(number, trial.params, state.name, value, results, why, judged)
        return outcome

    def _judge(self, folder: Path, outcome: Any) -> tuple:
        """(state, objective, why it failed, results) of one job in `folder`."""
        from hydra.core.utils import JobStatus
        from optuna.trial import TrialState

        results = layout.read_json(folder / layout.RESULTS)
        state, value, why = TrialState.FAIL, None, None
        if isinstance(outcome, BaseException):
            why = error_text(outcome)
            from gptlab.distributed import slurm

            why = slurm.job_error(str(folder)) or why
        elif outcome.status == JobStatus.FAILED:
            why = error_text(outcome._return_value)
        elif results is None:
            why = f"no {layout.RESULTS} in {folder}"
        elif results.get("stopped_by") == layout.PRUNED:
            state = TrialState.PRUNED
        elif results.get("stopped_by"):
            why = f"stopped by {results['stopped_by']} at step {results.get('steps')}"
        else:
            value = studies.objective(results, self.hs.metric)
            if value is None:
                why = f"its results have no {self.hs.metric} (got {results.get(self.hs.metric)})"
            else:
                state = TrialState.COMPLETE
        return state, value, why, results

    def _mean_of_seeds(self, judged: List[tuple]) -> tuple:
        """The outcome of a trial of several seeds.

        COMPLETE with their mean when every seed completed, else FAIL naming the first seed that did
        not.
        """
        from optuna.trial import TrialState

        for seed, (state, _, why, _) in zip(self.seed_values, judged):
            if state != TrialState.COMPLETE:
                return TrialState.FAIL, None, f"seed {seed}: {why or state.name.lower()}"
        values = [v for _, v, _, _ in judged]
        return TrialState.COMPLETE, sum(values) / len(values), None

    def _say(self, number, params, state, value, results, why, judged=()) -> None:
        shown = ", ".join(f"{k}={_fmt(v)}" for k, v in params.items())
        if state == "COMPLETE":
            text = f"{self.hs.metric} {value:.4f}"
            if len(judged) > 1:
                import statistics

                std = statistics.stdev([v for _, v, _, _ in judged])
                text += f" ± {std:.4f} (mean ± std of {len(judged)} seeds)"
        elif state == "PRUNED":
            text = f"pruned at step {(results or {}).get('steps')}"
        else:
            text = f"failed: {why}"
        best = self._best()
        tail = f" | best {best.value:.4f} (trial {best.number})" if best is not None else ""
        log.info(f"trial {number} ({shown}): {text}{tail}")

    def _best(self) -> Optional[Any]:
        try:
            return self.study.best_trial
        except ValueError:  # no trial completed yet
            return None

    def _check_failures(self) -> None:
        from optuna.trial import TrialState

        failed = [t for t in self.trials() if t.state == TrialState.FAIL]
        if len(failed) > self.allowed_failures:
            last = failed[-1]
            raise GptlabError(
                f"search stopped: {len(failed)} of {self.hs.n_trials} trials failed, more than "
                f"hparams_search.max_failure_rate={self.hs.max_failure_rate} allows; the last, "
                f"trial {last.number}: {last.system_attrs.get(studies.ERROR_ATTR)}"
            )

    def _summary(self, optuna: Any) -> None:
        from optuna.trial import TrialState

        trials = self.trials()
        counts = {s: sum(t.state == s for t in trials) for s in TrialState}
        best = self._best()
        best_text = (
            f"best {self.hs.metric} {best.value:.4f}, trial {best.number}: "
            + ", ".join(f"{k}={_fmt(v)}" for k, v in best.params.items())
            if best is not None
            else "no trial completed"
        )
        log.info(
            f"search {self.hs.study_name!r}: {counts[TrialState.COMPLETE]} complete, "
            f"{counts[TrialState.PRUNED]} pruned, {counts[TrialState.FAIL]} failed; {best_text}; "
            f"the trials: python -m gptlab.compare {self.sweep_dir}"
            + (" compare.metric=bpb" if "bpb" in self.hs.metric else "")
        )

    # --- heartbeat
    def _heartbeat(self) -> None:
        self.storage.set_study_system_attr(
            self.study_id, f"{studies.OWNER_ATTR}:{self.owner}", time.time()
        )

    def _beat(self) -> None:
        while not self.stop_beating.wait(HEARTBEAT_S):
            # a busy database: the next beat tries again
            with never_fatal(lambda e: log.debug(f"heartbeat: {e}")):
                self._heartbeat()

    # --- MLflow
    def _read_parent(self) -> Optional[Dict[str, Any]]:
        return layout.read_json(self.sweep_dir / layout.SWEEP)

    def _client(self) -> Any:
        from gptlab.records.store import mlflow_client

        return mlflow_client(self.parent["uri"])

    def _record_space(self) -> None:
        if not self.parent:
            return
        # the search goes on; the folders keep the records
        with never_fatal(
            lambda e: log.warning(f"could not record the search space in MLflow: {e}")
        ):
            from gptlab.records import store

            client = self._client()
            run_id = self.parent["parent_run_id"]
            store.log_params(
                client,
                run_id,
                {f"space/{k}"[:250]: spaces.describe(d) for k, d in self.space.items()},
            )
            for key, value in {
                "run_type": "search",
                "search.study": str(self.hs.study_name),
                "search.storage": studies.redact(self.url),
                "search.metric": self.hs.metric,
                "search.direction": self.direction,
                "search.n_trials": str(self.hs.n_trials),
            }.items():
                client.set_tag(run_id, key, value)

    def _record_trial(self, number, params, state, value, results, why) -> None:
        if not self.parent:
            return
        with never_fatal(lambda e: log.warning(f"could not record trial {number} in MLflow: {e}")):
            client = self._client()
            ids = [(r or {}).get("mlflow_run_id") for r in results]
            if not all(ids):  # a job that died before its results: its runs by folder
                ids = self._runs_of(number)
            for run_id in ids:
                client.set_tag(run_id, "search.trial", str(number))
                client.set_tag(run_id, "search.state", state)
                if value is not None:
                    client.log_metric(run_id, "search/objective", value)
                if why:
                    client.set_tag(run_id, "search.error", why[:5000])
            best = self._best()
            parent_id = self.parent["parent_run_id"]
            finished = sum(t.state.is_finished() for t in self.study.get_trials(deepcopy=False))
            client.set_tag(parent_id, "search.finished", str(finished))
            if best is not None:
                client.log_metric(parent_id, "search/best_value", best.value, step=finished)
                client.set_tag(parent_id, "search.best_trial", str(best.number))
                for k, v in best.params.items():
                    client.set_tag(parent_id, f"search.best.{k}"[:250], str(v))

    def _runs_of(self, number: int) -> List[str]:
        """The ids of the parent's child runs made in trial `number`'s folder."""
        from gptlab.records import store

        folders = {str(f) for f in self.folders(number)}
        kids = store.children(
            self._client(), self.parent["experiment_id"], self.parent["parent_run_id"]
        )
        return [r.info.run_id for r in kids if r.data.tags.get("run_dir") in folders]


def check(config: DictConfig) -> None:
    """Check everything a search can be told wrong: settings, space, keys, storage.

    What is wrong is said in one line before anything is made of it (the sweep callback calls this
    before the MLflow parent run).
    """
    params = OmegaConf.to_container(config.hydra.sweeper.get("params") or {}, resolve=True)
    seeds = config.hydra.sweeper.get("seeds", 1)
    Search(config, None, params, seeds).prepare([str(o) for o in config.hydra.overrides.task])


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def cancel_and_wait(job: str, timeout_s: float = 300.0) -> None:
    """scancel a SLURM job and wait until it has left the queue.

    The job saves a checkpoint on SIGTERM.
    """
    try:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return  # no SLURM here: nothing to cancel
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            out = subprocess.run(
                ["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired):
            return
        if out.returncode != 0 or not out.stdout.strip():
            return
        time.sleep(1.0)
    raise GptlabError(f"SLURM job {job} did not end within {timeout_s:.0f}s of scancel")
