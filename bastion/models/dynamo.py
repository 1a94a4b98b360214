"""What torch.compile's dynamo keeps per process, as a decode needs it."""

from __future__ import annotations

import sys

import torch

RECOMPILES = 256  # graphs torch.compile may build per function (its default, 8, a decode passes)


def allow_recompiles() -> None:
    """Even with dynamic shapes a decode meets more specialisations than torch.compile's default
    8 graphs per function (batch sizes, N = 1 or more, one or several key blocks, a tree or
    none), and past that limit dynamo silently runs the function eagerly: eager FlexAttention
    builds the very score matrices it exists to avoid. Dynamo's limit is per process."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILES)


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process so far, recompiles included, plus the CUDA
    graphs it has recorded (a graphed forward records a shape on its next call after compiling
    it): a step during which this grew spent its time compiling or recording, whichever function
    (the forward, flex) did. 0 while dynamo was never imported (importing it takes seconds: not
    inside a timed step)."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0
    # a recording counts the graph's inputs that are copied into it at each replay: a forward has some (its tokens)
    return utils.counters["stats"]["unique_graphs"] + utils.counters["inductor"]["cudagraph_recorded_non_static_inputs"]
