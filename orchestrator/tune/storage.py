"""The study's Optuna storage, shared by tuner processes on one machine or many.

- `study_lock` serializes "count trials, then ask" between the processes of one study.
- `study_storage` gives every trial its owner (host:pid) from the moment it exists, so a trial
  left RUNNING by a process that died is recognised as orphaned (`orphaned`), and on a server
  database retries calls while the database restarts.
- `journal:///path` (relative, as `sqlite:///`; `journal:////abs/path` absolute) is Optuna's
  JournalStorage over a file: a study shared by processes on many machines with no database
  server, through a shared file system (its writes and the count lock are symlink locks, which
  hold on NFS).
- `check_shared` refuses SQLite where several machines' processes share the study.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator, Optional

from ..rundir import process_gone, process_tag
from ..schema import ConfigError
from ..stores import JOURNAL, redact, sqlite_path, store_lock

STORAGE_RETRY_S = 30.0  # how long a tuner waits for a server database to come back before it stops
JOURNAL_LOCK_GRACE_S = 60  # a count lock older than this is a dead holder's (a cancelled worker): broken
NETWORK_FS = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "smbfs", "ceph", "fuse.sshfs", "glusterfs",
              "fuse.glusterfs", "panfs", "wekafs", "9p")


def journal_path(url: str) -> Optional[Path]:
    """The journal file of a `journal:///` URL (resolved: stores.resolve_uri); None for any other URL."""
    return Path(url[len(JOURNAL):]) if url.startswith(JOURNAL) else None


def file_system(path: Path) -> str:
    """The type of the file system holding `path` (its longest mount point in /proc/mounts), or ''."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return ""
    target = os.path.realpath(path.parent if not path.exists() else path)
    best = ("", "")
    for point, kind in mounts:
        point = point.replace("\\040", " ")
        if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) > len(best[0]):
            best = (point, kind)
    return best[1]


def check_shared(url: str, machines: bool) -> Optional[str]:
    """SQLite for a study: refused (ConfigError, one line) when processes on several machines
    share it (`machines`: SLURM workers), since its locks do not hold on a network file system and
    a local file is not seen by other nodes; otherwise a one-line warning (returned) when the file
    is on a network file system. Other storages: None."""
    db = sqlite_path(url)
    if db is None:
        return None
    kind = file_system(db)
    if machines:
        raise ConfigError(f"tune.storage: SQLite ({redact(url)}) cannot be shared by workers on several nodes (its "
                          "locks do not hold on a network file system, a local file is not seen by the other nodes); "
                          "allowed: journal:///<path on the shared file system>, or a database server "
                          "(postgresql+psycopg://...)")
    if kind in NETWORK_FS:
        return (f"[tune] warning: tune.storage {redact(url)} is SQLite on a network file system ({kind}), where its "
                "locks may not hold; use journal:///<path> or a database server to share a study")
    return None


@contextlib.contextmanager
def _journal_lock(path: Path, name: str) -> Iterator[None]:
    """Optuna's own symlink lock (holds on NFS), on a file beside the journal, keyed by the study."""
    from optuna.storages.journal import JournalFileSymlinkLock

    lock = JournalFileSymlinkLock(str(path.with_name(f"{path.name}.{name}")), grace_period=JOURNAL_LOCK_GRACE_S)
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


# A RUNNING trial with no owner this old was created by a process that failed between creating it
# and recording itself (every call of that pair is retried for at most STORAGE_RETRY_S).
ORPHAN_AFTER_S = 3 * STORAGE_RETRY_S


def study_lock(storage: str, study_name: str):
    """Serializes 'count trials, then ask' between tuner processes sharing a study, so together
    they run exactly n_trials: a lock file beside a SQLite DB, an advisory lock on PostgreSQL
    (processes on any machine), a symlink lock beside a journal file (processes of any machine
    sharing its file system). Other server databases: each process may overshoot by one."""
    journal = journal_path(storage)
    if journal is not None:
        return _journal_lock(journal, f"study.{study_name}")
    return store_lock(storage, f"study.{study_name}")


def orphaned(trial: Any, now: Optional[datetime] = None) -> bool:
    """A RUNNING trial nobody will finish: its owner is a process of this host that no longer
    exists, or it has had no owner for ORPHAN_AFTER_S. (Processes on other hosts cannot be
    checked from here.)"""
    who = str(trial.user_attrs.get("owner", ""))
    if not who:
        start = trial.datetime_start
        return start is not None and ((now or datetime.now(start.tzinfo)) - start).total_seconds() > ORPHAN_AFTER_S
    return process_gone(who)


def study_storage(url: str) -> Any:
    """An Optuna RDBStorage for `url` whose trials carry their owner from birth: a trial it
    creates holds `owner` in the same transaction, and one it takes from the queue (an enqueued
    trial) records it right after. On a server database, with pre-ping (connections a restart
    closed are replaced) and calls retried on connection errors for STORAGE_RETRY_S: a database
    restarted in the middle of a study (seconds) is waited for, not a reason to die."""
    import optuna
    import sqlalchemy.exc
    from optuna.trial import FrozenTrial

    class OwnedStorage(_TakenOwned, optuna.storages.RDBStorage):
        # private: Optuna's _CachedStorage, which wraps every RDBStorage, calls this, not create_new_trial
        def _create_new_trial(self, study_id: int, template_trial: Optional[FrozenTrial] = None) -> FrozenTrial:
            if template_trial is None:
                template_trial = _owned_trial()
            return super()._create_new_trial(study_id, template_trial)

    journal = journal_path(url)
    if journal is not None:
        return _owned_journal(journal)
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


def _owned_trial() -> Any:
    """A new trial's template that names its owner from birth (a tuner that dies before it sets
    the attribute still leaves a trial another process can reclaim)."""
    from optuna.trial import FrozenTrial, TrialState

    return FrozenTrial(number=-1, state=TrialState.RUNNING, value=None, datetime_start=datetime.now(),
                       datetime_complete=None, params={}, distributions={}, user_attrs={"owner": process_tag()},
                       system_attrs={}, intermediate_values={}, trial_id=-1)


class _TakenOwned:
    """Mixed into a storage: a WAITING trial a process takes (RUNNING) is re-owned by it."""

    def set_trial_state_values(self, trial_id: int, state: Any, values: Any = None) -> bool:
        from optuna.trial import TrialState

        taken = super().set_trial_state_values(trial_id, state, values)  # type: ignore[misc]
        if taken and state == TrialState.RUNNING:
            self.set_trial_user_attr(trial_id, "owner", process_tag())  # type: ignore[attr-defined]
        return taken


def _owned_journal(path: Path) -> Any:
    """Optuna's JournalStorage over `path` whose trials carry their owner from birth (as OwnedStorage)."""
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock, JournalStorage
    from optuna.trial import FrozenTrial

    class OwnedJournal(_TakenOwned, JournalStorage):
        def create_new_trial(self, study_id: int, template_trial: Optional[FrozenTrial] = None) -> int:
            if template_trial is None:
                template_trial = _owned_trial()
            return super().create_new_trial(study_id, template_trial)

    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return OwnedJournal(JournalFileBackend(str(path), lock_obj=JournalFileSymlinkLock(str(path))))


def is_storage_error(exc: BaseException) -> bool:
    """A failure of the study's database (connection lost, server restarted), not of a trial."""
    import sqlalchemy.exc
    from optuna.exceptions import StorageInternalError

    return isinstance(exc, (StorageInternalError, sqlalchemy.exc.SQLAlchemyError))
