"""The study's Optuna storage, shared by tuner processes on one machine or many.

- `study_lock` serializes "count trials, then ask" between the processes of one study.
- `study_storage` gives every trial its owner (host:pid) from the moment it exists, so a trial
  left RUNNING by a process that died is recognised as orphaned (`orphaned`), and on a server
  database retries calls while the database restarts.
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any, Optional

from ..rundir import process_gone, process_tag
from ..stores import sqlite_path, store_lock

STORAGE_RETRY_S = 30.0  # how long a tuner waits for a server database to come back before it stops
# A RUNNING trial with no owner this old was created by a process that failed between creating it
# and recording itself (every call of that pair is retried for at most STORAGE_RETRY_S).
ORPHAN_AFTER_S = 3 * STORAGE_RETRY_S


def study_lock(storage: str, study_name: str):
    """Serializes 'count trials, then ask' between tuner processes sharing a study, so together
    they run exactly n_trials: a lock file beside a SQLite DB, an advisory lock on PostgreSQL
    (processes on any machine). Other server databases: each process may overshoot by one."""
    return store_lock(storage, f"study.{study_name}")


def orphaned(trial: Any, now: Optional[datetime] = None) -> bool:
    """A RUNNING trial nobody will finish: its owner is a process of this host that no longer
    exists, or it has had no owner for ORPHAN_AFTER_S. (Processes on other hosts cannot be
    checked from here.)"""
    who = str(trial.user_attrs.get("owner", ""))
    if not who:
        start = trial.datetime_start
        return start is not None and ((now or datetime.now()) - start).total_seconds() > ORPHAN_AFTER_S
    return process_gone(who)


def study_storage(url: str) -> Any:
    """An Optuna RDBStorage for `url` whose trials carry their owner from birth: a trial it
    creates holds `owner` in the same transaction, and one it takes from the queue (an enqueued
    trial) records it right after. On a server database, with pre-ping (connections a restart
    closed are replaced) and calls retried on connection errors for STORAGE_RETRY_S: a database
    restarted in the middle of a study (seconds) is waited for, not a reason to die."""
    import optuna
    import sqlalchemy.exc
    from optuna.trial import FrozenTrial, TrialState

    class OwnedStorage(optuna.storages.RDBStorage):
        def _create_new_trial(self, study_id: int, template_trial: Optional[FrozenTrial] = None) -> FrozenTrial:
            if template_trial is None:
                template_trial = FrozenTrial(
                    number=-1, state=TrialState.RUNNING, value=None, datetime_start=datetime.now(),
                    datetime_complete=None, params={}, distributions={}, user_attrs={"owner": process_tag()},
                    system_attrs={}, intermediate_values={}, trial_id=-1)
            return super()._create_new_trial(study_id, template_trial)

        def set_trial_state_values(self, trial_id: int, state: TrialState, values: Any = None) -> bool:
            taken = super().set_trial_state_values(trial_id, state, values)
            if taken and state == TrialState.RUNNING:
                self.set_trial_user_attr(trial_id, "owner", process_tag())
            return taken

    if sqlite_path(url) is not None:
        return OwnedStorage(url)

    class RetryingStorage(OwnedStorage):
        def __getattribute__(self, name: str) -> Any:
            attr = super().__getattribute__(name)
            if name.startswith("_") or not callable(attr):
                return attr

            def call(*args: Any, **kwargs: Any) -> Any:
                deadline = time.monotonic() + STORAGE_RETRY_S
                while True:
                    try:
                        return attr(*args, **kwargs)
                    except (optuna.exceptions.StorageInternalError, sqlalchemy.exc.OperationalError):
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.5)

            return call

    return RetryingStorage(url, engine_kwargs={"pool_pre_ping": True})


def is_storage_error(exc: BaseException) -> bool:
    """A failure of the study's database (connection lost, server restarted), not of a trial."""
    import sqlalchemy.exc
    from optuna.exceptions import StorageInternalError

    return isinstance(exc, (StorageInternalError, sqlalchemy.exc.SQLAlchemyError))
