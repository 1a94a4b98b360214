"""One-line errors for bad input at the command line.

Entry points wrap their work in `user_errors()`: a bad choice (unknown model, mismatched
drafter, missing data offline, impossible budget) raises ValueError, FileNotFoundError or
ModelNotFound with a message that says what to do, and the user sees that sentence, not a
traceback. HYDRA_FULL_ERROR=1 shows the traceback as usual.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

from bastion.models.loading import ModelNotFound

USER_ERRORS = (ValueError, FileNotFoundError, ModelNotFound)


@contextmanager
def user_errors():
    try:
        yield
    except USER_ERRORS as error:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
