"""Writing and reading back the files a run keeps: caches, training states, checkpoints,
converted models and training data.

A kill mid-write must not leave a file that breaks every later run, so each is written under a
temporary name beside it and renamed over it (a rename within one folder is atomic: readers see
the old file or the new one, never part of one). A file that still does not parse (written by
hand, by an older version, or cut short by a full disk) is refused in one sentence that names it
and says what to do. This module imports nothing of the package: every layer may use it.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside `path` to write to; it replaces `path` when the block ends
    without error and is removed when it raises. Its name is hidden (globs such as
    `*.safetensors` skip it) and carries the process id, so two processes writing the same
    file never write into one temporary file. The file gets the permissions a plain open()
    would give it (safetensors writes its files readable by their owner only, which kept
    drafters from the colleagues they were trained for)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_dir(path: str | Path, finished: str) -> Iterator[Path]:
    """A fresh folder beside `path` to build it in: it becomes `path` in one rename when the
    block ends without error, so `path` is complete whenever it exists, and is removed when it
    raises. Its name is hidden and carries the process id (parallel test workers convert one
    model at once); those that killed processes left are removed first. Another process may have
    published `path` meanwhile (it holds `finished`, a file only a complete one has): theirs is
    kept. A block that rebuilds `path` removes the old one last."""
    path = Path(path)
    for stale in path.parent.glob(f".{path.name}.partial-*"):
        pid = stale.name.rsplit("-", 1)[1]
        if pid.isdigit() and not running(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        try:
            tmp.rename(path)
        except OSError:
            if not (path / finished).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def running(pid: int) -> bool:
    """Whether process `pid` is alive (a folder it builds is still in use)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


def _umask() -> int:
    mask = os.umask(0)  # reading it means setting it: set it straight back
    os.umask(mask)
    return mask


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def read_json(path: str | Path, remedy: str):
    """The parsed JSON of `path`; text that is not JSON raises ValueError naming the file and
    `remedy` (what the user should do, e.g. "delete it to re-measure")."""
    try:
        return json.loads(Path(path).read_text())
    except ValueError as error:  # JSONDecodeError and UnicodeDecodeError both are ValueErrors
        raise ValueError(f"{path} is not valid JSON ({error}); {remedy}.") from None
