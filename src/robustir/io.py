"""File helpers shared by every stage: atomic writes, resumable JSONL output, sharding.

Long jobs never lose finished work: results are appended to a ``.partial`` file line by line (flushed),
and the final file appears only once the stage is complete (atomic rename). A re-run reads the partial
file, skips what is already there, and continues.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from .errors import ConfigError, DataError


@contextmanager
def atomic_write(path: str | Path, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[Any]:
    """Write ``path`` through a temporary file in the same folder, renamed into place on success only."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; the file gets the mode any other new file gets
        kwargs = {} if "b" in mode else {"encoding": encoding}
        with os.fdopen(fd, mode, **kwargs) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return mask


def write_json(path: str | Path, obj: Any) -> None:
    with atomic_write(path) as handle:
        json.dump(obj, handle, indent=2, ensure_ascii=False, sort_keys=False)
        handle.write("\n")


def open_binary(path: str | Path):
    """Open a file for reading bytes; ``.gz`` files are decompressed transparently."""
    path = Path(path)
    if path.suffix == ".gz":
        import gzip

        return gzip.open(path, "rb")
    return open(path, "rb")


def read_lines(handle: Any, path: str | Path) -> Iterator[bytes]:
    """The lines of a file opened with :func:`open_binary`; a ``.gz`` file that is not gzip data, or is cut
    short, is a :class:`DataError` (not a decompressor's traceback)."""
    import gzip
    import zlib

    number = 0
    try:
        for number, raw in enumerate(handle, start=1):
            yield raw
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        problem = "is not gzip-compressed" if isinstance(exc, gzip.BadGzipFile) else f"is a damaged gzip file ({exc})"
        raise DataError(path, f"{problem} (after line {number})",
                        fix="a .gz name must hold gzip data: re-compress it (gzip FILE), or drop the .gz from its name"
                        if isinstance(exc, gzip.BadGzipFile) else "re-create or re-download the file") from None


_BLOCK = 1 << 20  # read files in 1 MiB blocks
_FULL_HASH_LIMIT = 256 << 20  # model files larger than this are hashed by size + sampled blocks
_SAMPLED_BLOCKS = 16


def text_digest(text: str, size: int = 8) -> bytes:
    """The BLAKE2b digest (``size`` bytes) of a text's UTF-8 bytes -- a lone surrogate kept as its code unit -- the
    one text hash every stage derives its ids and duplicate keys from (training's passage ids, the audit's duplicate
    counts, the Arrow store's distinct passages, mining's passage matching)."""
    import hashlib

    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=size).digest()


def _file_digest(path: Path, sample_large: bool) -> str:
    """``sha256:<hex>`` of the whole file, streamed; with ``sample_large``, a file over 256 MiB is digested from
    its size and 16 evenly spaced 1 MiB blocks (first and last included): ``sampled-sha256:<hex>``."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        if sample_large and size > _FULL_HASH_LIMIT:
            digest.update(str(size).encode())
            last = size - _BLOCK
            for i in range(_SAMPLED_BLOCKS):
                handle.seek(last * i // (_SAMPLED_BLOCKS - 1))
                digest.update(handle.read(_BLOCK))
            return "sampled-sha256:" + digest.hexdigest()
        for block in iter(lambda: handle.read(_BLOCK), b""):
            digest.update(block)
    return "sha256:" + digest.hexdigest()


def input_digest(paths: str | os.PathLike | Iterable[str | os.PathLike], *, model: bool = False,
                 skip: tuple[str, ...] = ("README.md",)) -> dict[str, Any]:
    """Digest of one input: a file, a folder (every file under it but hidden ones and those named in ``skip``,
    by default a model card ``README.md``) or a list of files and folders. Returns ``{"paths": [...], "files": {name: digest}}``: files are named relative to the
    folder they were found in (or by their own name).

    ``model=True`` (model and head folders): files over 256 MiB (weights) are digested from their size and 16
    sampled 1 MiB blocks, so a multi-GB model costs 16 MiB of reading, yet any other model of the same size
    differs; data files are always hashed whole.
    """
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    files: dict[str, str] = {}
    for item in items:
        item = Path(item)
        if item.is_dir():
            for file in sorted(item.rglob("*")):
                relative = file.relative_to(item)
                if not file.is_file() or any(part.startswith(".") for part in relative.parts) \
                        or relative.as_posix() in skip:
                    continue
                files[relative.as_posix()] = _file_digest(file, model)
        elif item.is_file():
            files[item.name] = _file_digest(item, model)
        else:
            files[item.name] = "missing"
    return {"paths": [str(Path(p)) for p in items], "files": files}


def _show(value: Any, limit: int = 100) -> str:
    """A value for a message: JSON, long ones cut in the middle (the end of a path tells most)."""
    text = json.dumps(value, ensure_ascii=False, sort_keys=True)
    return text if len(text) <= limit else text[:limit // 3] + "..." + text[-(2 * limit // 3):]


def describe_changes(old_values: dict, new_values: dict, old_inputs: dict, new_inputs: dict) -> list[str]:
    """What differs between two records of a run or stage output, one phrase each: settings (``lr: 0.001 ->
    0.002``, ``(not set)`` when absent on one side) and inputs (``name -> input_digest(...)``: which files changed,
    went or came). Empty when they are equal."""
    diffs = []
    for key in list(old_values) + [k for k in new_values if k not in old_values]:
        if key not in new_values:
            diffs.append(f"{key}: {_show(old_values[key])} -> (not set)")
        elif key not in old_values:
            diffs.append(f"{key}: (not set) -> {_show(new_values[key])}")
        elif old_values[key] != new_values[key]:
            diffs.append(f"{key}: {_show(old_values[key])} -> {_show(new_values[key])}")
    for name in list(old_inputs) + [k for k in new_inputs if k not in old_inputs]:
        before, after = old_inputs.get(name), new_inputs.get(name)
        if before is None or after is None:
            diffs.append(f"input {name}: {'(none)' if before is None else 'given'} -> "
                         f"{'(none)' if after is None else 'given'}")
            continue
        old_files, new_files = before.get("files", {}), after.get("files", {})
        changed = [f for f in old_files if f in new_files and old_files[f] != new_files[f]]
        removed = [f for f in old_files if f not in new_files]
        added = [f for f in new_files if f not in old_files]
        if changed or removed or added:
            parts = ([f"content of {', '.join(changed[:5])} changed"] if changed else []) + \
                    ([f"{', '.join(removed[:5])} no longer there"] if removed else []) + \
                    ([f"{', '.join(added[:5])} added"] if added else [])
            diffs.append(f"input {name} ({', '.join(after.get('paths', []))}): {'; '.join(parts)}")
    return diffs


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict]]:
    """Yield ``(line_number, object)`` for each non-empty line; bad JSON / UTF-8 raise :class:`DataError`."""
    for number, _, _, obj in read_jsonl_at(path):
        yield number, obj


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def parse_json_line(line: str, path: str | Path, number: int) -> Any:
    """One JSON value of a JSONL line, every defect a :class:`DataError` naming the file, line (and field): invalid
    JSON, nesting too deep for the parser, a number too long to convert, a lone UTF-16 surrogate escape (valid JSON,
    but no Unicode text: ``"\\ud800"``, which every later UTF-8 encoder refuses)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(path, f"invalid JSON ({exc.msg} at column {exc.colno})", line=number,
                        fix="each line must hold exactly one JSON object") from None
    except RecursionError:
        raise DataError(path, "JSON nested too deeply to read", line=number,
                        fix="flatten the record: robustir reads a few levels of objects and lists") from None
    except ValueError as exc:  # an integer of more than 4,300 digits (Python's conversion limit)
        problem = "a JSON number has more than 4,300 digits" if "digits" in str(exc) else f"a JSON value cannot be " \
                                                                                            f"read ({exc})"
        raise DataError(path, problem, line=number, fix="write long numbers as strings") from None
    if "\\u" in line and _SURROGATE_ESCAPE.search(line):  # a pair decodes to one character; a lone half stays one
        where = _lone_surrogate(obj)
        if where is not None:
            raise DataError(path, "a lone UTF-16 surrogate (\\ud800-\\udfff without its pair) is not Unicode text",
                            line=number, field=where or None,
                            fix="repair the text's encoding (the writer split a surrogate pair), or drop the character")
    return obj


def _lone_surrogate(value: Any, where: str = "") -> str | None:
    """The key path of the first string (or key) holding a lone surrogate; None when there is none."""
    stack = [(value, where)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return at
        elif isinstance(item, dict):
            for key, child in item.items():
                name = f"{at}.{key}" if at else str(key)
                if isinstance(key, str):
                    try:
                        key.encode("utf-8")
                    except UnicodeEncodeError:
                        return f"{at} (a key)" if at else "(a key)"
                stack.append((child, name))
        elif isinstance(item, list):
            stack.extend((child, f"{at}[{i}]") for i, child in enumerate(item))
    return None


def read_jsonl_at(path: str | Path, start: int = 0, stop: int | None = None,
                  first_line: int = 1) -> Iterator[tuple[int, int, int, dict]]:
    """:func:`read_jsonl` with where each line lies: ``(line_number, byte offset, byte length, object)``, offsets
    into the decompressed bytes of a ``.gz`` file, so a reader can index a file once and seek back to a record.

    ``start``/``stop``/``first_line``: only the lines in the bytes ``[start, stop)`` of a plain (not ``.gz``) file,
    ``start`` being where line ``first_line`` begins -- what another process reads of a file this one indexed (the
    Ray read tasks of dense mining, :func:`robustir.data.beir.read_corpus_range`), with the same checks and numbers."""
    path = Path(path)
    if not path.exists():
        raise DataError(path, "file not found", fix="check the path (relative paths are taken from the current folder)")
    if (start or stop is not None) and path.suffix == ".gz":
        raise ValueError("a byte range is read from a plain file only")
    offset = start
    with open_binary(path) as handle:
        if start:
            handle.seek(start)
        for number, raw in enumerate(read_lines(handle, path), start=first_line):
            if stop is not None and offset >= stop:
                break
            at, offset = offset, offset + len(raw)
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # a byte-order mark is allowed
            except UnicodeDecodeError as exc:
                raise DataError(path, f"not valid UTF-8 at byte {exc.start}", line=number,
                                fix="re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8)") from None
            if not line.strip():
                continue
            obj = parse_json_line(line, path, number)
            if not isinstance(obj, dict):
                raise DataError(path, f"expected a JSON object, got {type(obj).__name__}", line=number,
                                fix="each line must hold one JSON object such as {\"query\": ...}")
            yield number, at, len(raw), obj


def try_lock(file: Path, attempts: int = 20) -> int | None:
    """An exclusive ``flock`` on ``file`` (created if missing): its descriptor, or None when another process holds it.

    Released by closing the descriptor, or when the process dies, even by kill -9. A few quick retries let a
    reader's probe (which holds the lock for microseconds) pass.
    """
    import fcntl
    import time

    fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o644)
    for _ in range(attempts):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            time.sleep(0.05)
    os.close(fd)
    return None


class ResumableJsonlWriter:
    """Append-only JSONL output that survives crashes.

    Records go to ``<path>.partial`` (one line each, flushed); :meth:`finish` renames it to ``path``.
    ``done_keys`` holds the ``key_field`` value of every record already written, so a re-run skips them.
    A torn last line (crash mid-write) is dropped on open.
    """

    def __init__(self, path: str | Path, key_field: str | None = None) -> None:
        self.path = Path(path)
        self.partial = self.path.with_name(self.path.name + ".partial")
        self.key_field = key_field
        self.done_keys: set[Any] = set()
        self.count = 0
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.partial.exists():
            self._recover()
        self._handle = open(self.partial, "a", encoding="utf-8")

    def _recover(self) -> None:
        good: list[str] = []
        with open(self.partial, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if not line.endswith("\n"):
                    break  # torn write from a crash: drop it, it will be redone
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    break
                good.append(line)
                if self.key_field is not None:
                    self.done_keys.add(_hashable(obj.get(self.key_field)))
        with atomic_write(self.partial) as handle:
            handle.writelines(good)
        self.count = len(good)

    def write(self, record: dict) -> None:
        self._handle.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._handle.flush()
        self.count += 1
        if self.key_field is not None:
            self.done_keys.add(_hashable(record.get(self.key_field)))

    def finish(self) -> Path:
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()
        os.replace(self.partial, self.path)
        return self.path

    def close(self) -> None:
        if not self._handle.closed:
            self._handle.flush()
            self._handle.close()

    def __enter__(self) -> "ResumableJsonlWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _hashable(value: Any) -> Any:
    return json.dumps(value, sort_keys=True) if isinstance(value, (list, dict)) else value


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count`` (0-based index), as given by ``--shard i/n`` (1-based on the command line)."""

    index: int = 0
    count: int = 1

    @classmethod
    def parse(cls, text: str | None) -> "Shard":
        if text in (None, "", "1/1"):
            return cls()
        try:
            i, n = (int(x) for x in str(text).split("/"))
        except ValueError:
            raise ConfigError(f"--shard {text!r}: expected I/N such as 3/16 (shard 3 of 16, counting from 1)") from None
        if not (n >= 1 and 1 <= i <= n):
            raise ConfigError(f"--shard {text!r}: need 1 <= I <= N")
        return cls(i - 1, n)

    def owns(self, position: int) -> bool:
        """Round-robin assignment: item number ``position`` belongs to this shard?"""
        return position % self.count == self.index

    def select(self, items: Iterable[Any]) -> Iterator[Any]:
        for position, item in enumerate(items):
            if self.owns(position):
                yield item

    def suffix(self) -> str:
        return "" if self.count == 1 else f".shard-{self.index + 1:05d}-of-{self.count:05d}"

    def __str__(self) -> str:
        return f"{self.index + 1}/{self.count}"
