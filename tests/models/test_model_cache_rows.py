"""A decode batch writes its rows' new cache rows (keys and values, or latents) in one kernel per block."""

import collections

import numpy as np
from tinygrad import Tensor, dtypes

from models.config import config_from_arch
from models.kernels.cache_rows import store_rows
from models.stage import StageInput, StageModel
from planner.arch import ArchSpec

TINY = ArchSpec("tiny", n_blocks=2, hidden=128, ffn=256, n_heads=4, n_kv_heads=2, head_dim=32, vocab=500)


def test_each_row_lands_at_its_own_slot_and_position_and_nothing_else_changes():
    rng = np.random.default_rng(3)
    before = rng.standard_normal((2, 5, 2, 16, 8)).astype(np.float32)  # (kind, slot, kv head, row, head_dim)
    new = rng.standard_normal((4, 2, 2, 8)).astype(np.float32)
    slots, starts = [3, 0, 0, 1], [15, 6, 7, 0]  # two rows of one slot at consecutive positions (a verify step's)
    cache = Tensor(before).contiguous().realize()
    after = store_rows(cache, Tensor(new), Tensor(slots, dtype=dtypes.int32), Tensor(starts, dtype=dtypes.int32),
                       slot_axis=1, row_axis=3).numpy()
    want = before.copy()
    for b, (s, p) in enumerate(zip(slots, starts, strict=True)):
        want[:, s, :, p, :] = new[b]
    assert np.array_equal(after, want)
    assert np.array_equal(cache.numpy(), want)  # written in place: the stage's cache itself


def test_a_latent_cache_takes_its_rows_in_its_own_dtype():
    cache = Tensor.zeros(3, 10, 6, dtype=dtypes.float16).contiguous().realize()  # (slot, row, latent)
    new = np.arange(12, dtype=np.float32).reshape(2, 6) + 0.25
    store_rows(cache, Tensor(new), Tensor([2, 0], dtype=dtypes.int32), Tensor([9, 4], dtype=dtypes.int32),
               slot_axis=0, row_axis=1)
    got = cache.numpy()
    assert got.dtype == np.float16 and np.array_equal(got[2, 9], new[0].astype(np.float16))
    assert np.array_equal(got[0, 4], new[1].astype(np.float16)) and np.count_nonzero(got) == 12


def decode_graph_kernels(rows: int) -> collections.Counter:
    """The kernels, by name, of the captured decode graph of `rows` requests in distinct slots (whole cache tiles,
    one set of attention kernels in slot order, as on a GPU)."""
    from tinygrad.helpers import ansistrip
    from tinygrad.uop.ops import Ops

    model = StageModel.random(config_from_arch(TINY, 32), seed=5, max_context=32, max_requests=rows,
                              dtype="float32", attention_tile=8, prefill_chunk=8)
    rids = [f"r{b}" for b in range(rows)]
    for rid in rids:
        model.add_request(rid)
        model.forward([StageInput(rid, 0, np.arange(1, 6))])
    for step in range(3):  # the graph is captured on the second step
        model.forward([StageInput(r, 5 + step, np.array([7])) for r in rids])
    (jit,) = model._decode_jits.values()

    def name(call) -> str:
        sink = next(u for u in call.src[0].toposort() if u.op is Ops.SINK and u.arg is not None)
        return ansistrip(sink.arg.name)

    return collections.Counter(name(u) for u in jit.captured.linear.toposort()
                               if u.op is Ops.CALL and u.src[0].op is not Ops.CUSTOM_FUNCTION)


def test_a_decode_batch_runs_as_many_kernels_at_sixteen_rows_as_at_four():
    four, sixteen = decode_graph_kernels(4), decode_graph_kernels(16)
    assert four["store_rows"] == sixteen["store_rows"] == TINY.n_blocks
    assert sum(four.values()) == sum(sixteen.values())  # no kernel per row, and no copy of a cache per block
