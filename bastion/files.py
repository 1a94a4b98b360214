"""Writing and reading back the files a run keeps: caches, training states, checkpoints.

A kill mid-write must not leave a file that breaks every later run, so each is written under a
temporary name beside it and renamed over it (a rename within one folder is atomic: readers see
the old file or the new one, never part of one). A file that still does not parse (written by
hand, by an older version, or cut short by a full disk) is refused in one sentence that names it
and says what to do. This module imports nothing of the package: every layer may use it.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary path beside `path` to write to; it replaces `path` when the block ends
    without error and is removed when it raises. Its name is hidden (globs such as
    `*.safetensors` skip it) and carries the process id, so two processes writing the same
    file never write into one temporary file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


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
