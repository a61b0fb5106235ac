"""The reply cache every backend shares: one sqlite3 file (WAL), keyed by :func:`~robustir.llm.base.cache_key`."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError


@dataclass
class Completion:
    """One reply: ``text`` is ``None`` when the request failed (``error`` says why) under ``on_failure: skip``."""

    text: str | None
    cached: bool = False
    error: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.text is not None


class LLMCache:
    """Persistent reply cache in one sqlite3 file (WAL mode, so shards in other processes may share it).

    Only successful replies are stored, each committed as soon as it arrives: a crash loses at most the
    requests that were still in flight.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(str(self.path), timeout=60.0, check_same_thread=False,
                                       isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL survives a process crash
            self._db.execute("CREATE TABLE IF NOT EXISTS replies (key TEXT PRIMARY KEY, model TEXT, "
                             "reply TEXT NOT NULL, usage TEXT, created REAL)")
        except sqlite3.DatabaseError as exc:
            raise ConfigError(f"LLM cache {self.path}: cannot open ({exc}); delete the file or choose another "
                              f"cache_path") from None

    def get(self, key: str) -> Completion | None:
        with self._lock:
            row = self._db.execute("SELECT reply, usage FROM replies WHERE key = ?", (key,)).fetchone()
        if row is None:
            return None
        usage = json.loads(row[1]) if row[1] else {}
        return Completion(row[0], cached=True, prompt_tokens=usage.get("prompt_tokens"),
                          completion_tokens=usage.get("completion_tokens"))

    def put(self, key: str, model: str, completion: Completion) -> None:
        usage = json.dumps({"prompt_tokens": completion.prompt_tokens,
                            "completion_tokens": completion.completion_tokens})
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO replies VALUES (?, ?, ?, ?, ?)",
                             (key, model, completion.text, usage, time.time()))

    def delete(self, key: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM replies WHERE key = ?", (key,))

    def __len__(self) -> int:
        with self._lock:
            return int(self._db.execute("SELECT COUNT(*) FROM replies").fetchone()[0])

    def close(self) -> None:
        with self._lock:
            self._db.close()

