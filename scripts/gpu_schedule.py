"""A stage's blocks as tinygrad schedules them for an NVIDIA GPU, built on any machine without running them: the CPU
device takes the GPUs' paths, the hand-written kernels' checks answer as on an sm_90 GPU (an H100 / H200), and
nothing inside the blocks is realised (the hand-written kernels are CUDA). For `kernel_census.py` and
`plan_hazards.py`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def gpu_stage(model: str, start: int, end: int) -> Any:
    """Blocks [start, end) of `model` (a name or a GGUF file) on the CPU, taking the GPUs' paths from now on."""
    import models.stage
    from models.catalog.names import resolve_model
    from tests.models.sm90 import take_gpu_paths

    take_gpu_paths("CPU")
    return models.stage.StageModel.from_gguf(resolve_model(model).path, start, end, dtype="quantized",
                                             experts_in_graph=True, attention_tile=128, max_context=64)


def unrealised_blocks(stage: Any, blocks: range, *, batch: int = 1, chunk: int = 0) -> Any:
    """The output of `blocks` for a decode step of `batch` rows (at positions 5, 6, ...), or for a prompt's first
    chunk of `chunk` tokens, left lazy: (rows, hidden)."""
    from tinygrad import Tensor, dtypes

    if chunk:
        h = Tensor.rand(1, chunk, stage.hidden_size).realize()
        angles = stage._rope[0:chunk].reshape(1, 1, chunk, -1).realize()
        rows: dict = {"slots": [0], "starts": [0], "T": chunk}
    else:
        slots, starts = list(range(batch)), [5 + r for r in range(batch)]
        h = Tensor.rand(batch, 1, stage.hidden_size).realize()
        angles = stage._rope[5:5 + batch].reshape(batch, 1, 1, -1).realize()
        at = (Tensor(slots, dtype=dtypes.int32).realize(), Tensor(starts, dtype=dtypes.int32).realize())
        rows = {"slots": slots, "starts": starts, "T": 1, "tiles": (1,) * batch, "at": at}
    realize = Tensor.realize
    Tensor.realize = lambda self, *a, **k: self
    try:
        for i in blocks:
            h = stage._block(i, h, rows["slots"], rows["starts"], rows["T"], angles, rows.get("tiles", ()),
                             at=rows.get("at"))
    finally:
        Tensor.realize = realize
    return h.reshape(-1, stage.hidden_size)
