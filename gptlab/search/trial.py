"""A trial's side of the search, inside its training job.

At each evaluation rank 0 reports the figure the objective is made of (val_loss for best_val_loss)
to the study and asks the pruner whether the trial is hopeless; every rank hears the answer, so all
stop at the same step. A pruned trial saves its checkpoint and ends like a finished run, with
results.json saying `stopped_by: pruned`; the sweeper then records it as pruned.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, Optional

from gptlab.distributed import world as distributed
from gptlab.errors import GptlabError, Superseded, never_fatal
from gptlab.search import study as studies

log = logging.getLogger(__name__)


class TrialLink:
    """The job's line to its trial in the study (opened on rank 0 only)."""

    def __init__(self, hs: Any, is_main: bool) -> None:
        self.number = int(hs.trial)
        self.superseded: Optional[str] = None
        self.reported = studies.METRICS[hs.metric][1]
        self.is_main = is_main
        self.storage = self.study = self.trial_id = None
        if not is_main:
            return
        self.storage = studies.open_storage(str(hs.storage))
        try:
            self.study = studies.load(self.storage, hs.study_name, hs)
            study_id = self.storage.get_study_id_from_name(hs.study_name)
            self.trial_id = self.storage.get_trial_id_from_study_id_trial_number(
                study_id, self.number
            )
        except KeyError:
            raise GptlabError(
                f"hparams_search: study {hs.study_name!r} has no trial {self.number} in "
                f"{studies.redact(str(hs.storage))}; a trial's job is started by the search "
                f"(python -m gptlab.train -m hparams_search=...)"
            ) from None
        job = os.environ.get("SLURM_JOB_ID")
        if job:  # a sweeper adopting this trial after its sweeper died cancels this job first
            self.storage.set_trial_system_attr(self.trial_id, studies.SLURM_ATTR, job)
        # read after the job id is written (the adopting sweeper raises the attempt, then reads
        # the id): a job queued by a dead sweeper either is cancelled or learns it is superseded
        current = self.storage.get_trial(self.trial_id).system_attrs.get(studies.ATTEMPT_ATTR, 0)
        if int(current) > int(hs.attempt):
            self.superseded = (
                f"trial {self.number}: this job is launch {hs.attempt} of it, and another sweeper "
                f"has launched it again (launch {current}); this job ends without touching its "
                f"folder"
            )

    def should_prune(self, step: int, figures: Dict[str, Any]) -> bool:
        """Report this evaluation's figure; whether the pruner stops the trial (all ranks)."""
        decision: Optional[bool] = None
        if self.is_main:
            decision = False
            value = figures.get(self.reported)
            if value is not None:
                # the trial goes on unpruned
                with never_fatal(
                    lambda e: log.warning(f"trial {self.number}: could not report step {step}: {e}")
                ):
                    self.storage.set_trial_intermediate_value(self.trial_id, step, float(value))
                    frozen = self.storage.get_trial(self.trial_id)
                    decision = bool(self.study.pruner.prune(self.study, frozen))
        return bool(distributed.broadcast_object(decision))


def open_link(hs: Any, is_main: bool) -> Optional[TrialLink]:
    """The trial's link when this job is a search trial (hparams_search.trial is set).

    A job that a later launch of its trial superseded stops here, on every rank, before it claims
    the folder.
    """
    if hs.trial is None:
        return None
    link = TrialLink(hs, is_main)
    superseded = distributed.broadcast_object(link.superseded)
    if superseded:
        raise Superseded(superseded)
    return link
