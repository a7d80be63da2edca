"""The Responses store's SQLite file: what survives a restart, a kill -9 and a damaged file.

One writer thread owns the connection; nothing here runs on the event loop. A row is a record's
delta (``store``): ``(id, namespace, owner, parent, created, body)``, ``body`` the JSON array
``[response, new input items, output items]`` (token ids are not kept on disk).

Start-up (``StoreFile(path).load(since)``)::

    open      journal_mode=WAL, synchronous=FULL, PRAGMA quick_check
              a file that is not a database, or is corrupt  -> moved aside to
              PATH.damaged-<UTC time> (its -wal and -shm too), one warning, an empty file
    read      every row; a row that does not decode (types, JSON, shape) is skipped and counted
    delete    the skipped rows, the rows older than ``since``, and the orphans (a row whose
              parent is not a kept row, so whose conversation cannot be rebuilt) in one commit

Durability: ``write`` commits a record with its unwritten ancestors in one transaction and
resolves once SQLite's commit returned; with WAL and ``synchronous=FULL`` a committed row
survives a kill -9 and a power loss (given a disk that honours fsync). The same transaction
deletes the rows older than the store's age bound. Each ``delete`` commits on its own, in order;
``flush`` resolves once every one submitted before it is done (a row whose delete a crash lost
comes back at the next start and is bounded then).
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from prefixserve.api.openai.responses.store import Record

logger = logging.getLogger(__name__)

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, namespace TEXT NOT NULL, "
    "owner TEXT NOT NULL, parent TEXT, created REAL NOT NULL, body TEXT NOT NULL)",
    "CREATE INDEX IF NOT EXISTS responses_created ON responses (created)",
)
_DAMAGE = ("SQLITE_NOTADB", "SQLITE_CORRUPT")  # error names (prefixes) that mean a damaged file
_DAMAGE_MESSAGES = ("file is not a database", "database disk image is malformed")  # Python 3.10


class Row(NamedTuple):
    """A decoded row: a record's delta, oldest first in ``load``."""

    id: str
    namespace: str
    owner: str
    parent: str | None
    created: float
    response: dict[str, Any]
    new_items: list[dict[str, Any]]
    output_items: list[dict[str, Any]]


class DamagedFile(sqlite3.DatabaseError):
    """``PRAGMA quick_check`` found the file corrupt."""


class StoreFile:
    """The SQLite file under a ``ResponseStore`` (see the module doc); ``load`` opens it."""

    _db: sqlite3.Connection  # opened by ``load``, on the writer thread

    def __init__(self, path: str) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="responses-store")

    def load(self, since: float) -> tuple[list[Row], int]:
        """Open the file: (the rows to keep, oldest first; how many rows were skipped)."""
        return self._writer.submit(self._load, since).result()

    def write(self, records: list[Record], expired_before: float) -> Future[bool]:
        """Commit ``records`` (a chain, root first) and delete the rows created before
        ``expired_before``: True once committed, False (logged) when it failed."""
        return self._writer.submit(self._write, records, expired_before)

    def delete(self, response_id: str) -> None:
        self._writer.submit(self._delete, response_id)

    def flush(self) -> Future[None]:
        """Done once every write and delete submitted before is done."""
        return self._writer.submit(lambda: None)

    def close(self) -> None:
        self._writer.submit(self._db.close).result()
        self._writer.shutdown()

    # -- on the writer thread -------------------------------------------------------------------

    def _load(self, since: float) -> tuple[list[Row], int]:
        try:
            raw = self._read()
        except sqlite3.DatabaseError as exc:
            if not _damaged(exc):
                raise
            self._db.close()
            aside = _move_aside(self.path)
            logger.warning("responses store: %s is damaged (%s); moved it to %s and started an "
                           "empty store", self.path, exc, aside)  # fmt: skip
            raw = self._read()
        rows, bad = {}, []
        for rowid, *columns in raw:
            row = _decode(columns)
            if row is None:
                bad.append(rowid)
            elif row.created >= since:
                rows[row.id] = (rowid, row)
        kept = _rooted(rows)
        gone = bad + [rowid for rid, (rowid, _) in rows.items() if rid not in kept]
        with self._db:
            self._db.execute("DELETE FROM responses WHERE created < ?", (since,))
            self._db.executemany("DELETE FROM responses WHERE rowid = ?",
                                 [(rowid,) for rowid in gone])  # fmt: skip
        if bad:
            logger.warning("responses store: skipped %d unreadable rows of %s (deleted)",
                           len(bad), self.path)  # fmt: skip
        if len(gone) > len(bad):
            logger.info("responses store: deleted %d rows of %s whose conversation's start is "
                        "gone", len(gone) - len(bad), self.path)  # fmt: skip
        return sorted((rows[rid][1] for rid in kept), key=lambda r: r.created), len(bad)

    def _read(self) -> list[tuple]:
        """Open the connection and check the file: every row (rowid first)."""
        db = self._db = sqlite3.connect(self.path, timeout=30, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        problems = [p for (p,) in db.execute("PRAGMA quick_check").fetchall()]
        if problems != ["ok"]:
            raise DamagedFile("; ".join(problems[:3]))
        for statement in _SCHEMA:
            db.execute(statement)
        db.commit()
        return db.execute(
            "SELECT rowid, id, namespace, owner, parent, created, body FROM responses"
        ).fetchall()

    def _write(self, records: list[Record], expired_before: float) -> bool:
        try:
            rows = [(r.id, r.namespace, r.owner, r.parent, r.created,
                     json.dumps([r.response, r.new_items, r.output_items], ensure_ascii=False))
                    for r in records]  # fmt: skip
            with self._db:
                self._db.executemany("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)",
                                     rows)  # fmt: skip
                self._db.execute("DELETE FROM responses WHERE created < ?",
                                 (expired_before,))  # fmt: skip
        except (sqlite3.Error, ValueError):  # ValueError: text SQLite cannot encode
            logger.exception("responses store: writing %s to %s failed; not stored",
                             records[-1].id, self.path)  # fmt: skip
            return False
        return True

    def _delete(self, response_id: str) -> None:
        try:
            with self._db:
                self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,))
        except sqlite3.Error:
            logger.exception("responses store: deleting %s from %s failed", response_id,
                             self.path)  # fmt: skip


def _damaged(exc: sqlite3.DatabaseError) -> bool:
    """The file is not a database or is corrupt (not: locked, unreadable, full, ...)."""
    name = getattr(exc, "sqlite_errorname", None)  # Python 3.11+
    if name is not None:
        return name.startswith(_DAMAGE)
    return isinstance(exc, DamagedFile) or str(exc) in _DAMAGE_MESSAGES


def _move_aside(path: str) -> str:
    """Rename the file (and its -wal and -shm) to ``PATH.damaged-<UTC time>``; the new name."""
    aside = f"{path}.damaged-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    for suffix in ("", "-wal", "-shm"):
        if Path(path + suffix).exists():
            Path(path + suffix).rename(aside + suffix)
    return aside


def _decode(columns: list[Any]) -> Row | None:
    """The row, or None when a column has the wrong type or the body is not
    ``[response object, items, items]``."""
    rid, namespace, owner, parent, created, body = columns
    if not (all(isinstance(c, str) for c in (rid, namespace, owner, body))
            and (parent is None or isinstance(parent, str))
            and isinstance(created, (int, float))):  # fmt: skip
        return None
    try:
        decoded = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(decoded, list) and len(decoded) == 3 and isinstance(decoded[0], dict)
            and all(isinstance(items, list) and all(isinstance(i, dict) for i in items)
                    for items in decoded[1:])):  # fmt: skip
        return None
    return Row(rid, namespace, owner, parent, float(created), *decoded)


def _rooted(rows: dict[str, tuple[int, Row]]) -> set[str]:
    """The ids whose parent chain reaches a root through ``rows`` (no orphan, no cycle)."""
    kept: set[str] = set()
    for start in rows:
        path: dict[str, None] = {}  # the walk from ``start`` towards its root
        rid: str | None = start
        while rid is not None and rid not in kept and rid in rows and rid not in path:
            path[rid] = None
            rid = rows[rid][1].parent
        if rid is None or rid in kept:
            kept.update(path)
    return kept
