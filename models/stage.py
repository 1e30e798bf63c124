"""A pipeline stage: blocks [start, end) of a Llama model on tinygrad, with a KV cache per request.

The weights live in tinygrad.llm's own `TransformerBlock`s under their GGUF names (`blk[i].attn_q`,
`ffn_gate`, ...), loaded by `models.gguf.loader`; its RMSNorms are called as they are. What is
written here is the step around them that tinygrad.llm's blocks cannot do: each request owns a slot
of a per-layer KV pool, so requests at different positions share a stage, and decode steps of
several requests run as one batch through one jitted step (one jit per padded batch size; slots and
positions are bound symbolic variables, so nothing recompiles as positions move). Prefill runs in
chunks with a symbolic start and token count, as `tinygrad.llm`'s `generate` does (the chunk's
row count is fixed and padded). Projections go through `models.kernels.matvec` (fused Q/K/V and
gate/up matrices, one pass each).

Mixture-of-experts blocks (`models.moe`) run their router and routed experts inside the same jitted
graph when the stage holds the experts (`local_experts=True`). When the experts live elsewhere, the
stage's graph is cut after each MoE block's router: `forward_steps` is a generator that yields one
`ExpertCall` per MoE layer and step (the FFN-normed rows, selected experts and gates of every
request in the batch) and resumes with the gate-weighted expert sum, which it adds to the residual
before the next segment; each segment is jitted like the whole stage.

`numerics` picks the arithmetic: "float" (float32 activations and KV cache over the weights as
loaded), or "ggml": llama.cpp's CPU arithmetic over GGML-block weights (8-bit activations before each
block-quantised product, float16 KV cache, query and softmax probabilities; `models.kernels.ggml_numerics`),
which follows llama.cpp's greedy tokens where float arithmetic leaves them at close calls.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from models import cached_graphs, deepseek2
from models.catalog.synthetic import random_weights
from models.deepseek2 import is_mla
from models.errors import ModelError
from models.expert_shard import ExpertShard, shared_expert, shared_expert_fits
from models.gguf.loader import StageParts
from models.kernels import ggml_numerics
from models.kernels.attention import (
    batch_rows_at,
    grouped_query_attention,
    half_product_attention,
    half_products_on,
    slot_ordered,
    slot_ordered_decode_attention,
    slot_span,
    tiled_decode_attention,
)
from models.kernels.cache_rows import write_rows
from models.kernels.cpu_attention import cpu_attention_fits, cpu_decode_attention
from models.kernels.cpu_gemv import cpu_gemv, cpu_gemv_fits
from models.kernels.float_gemv import float_gemv, float_gemv_fits
from models.kernels.gathered import block_matvec
from models.kernels.glu import silu_glu
from models.kernels.matvec import GPU_DEVICES, gpu_reduce, matvec, tune_cpu_renderer
from models.kernels.quant import BlockQuantized
from models.kernels.rms_norm import added_norm_on, added_rms_norm, rms_norm, rms_norm_fits
from models.kv_cache import KVCacheFull, KVPool, LatentPool, SlotTable
from models.moe import (
    ROUTED_WEIGHTS,
    ExpertCall,
    ExpertFn,
    block_config,
    is_moe_block,
    route,
    routed_experts,
    shared_experts,
)
from models.tinygrad_ext.jit import Bind, HeldInputs, RecordedCalls, capturing, read_back

if TYPE_CHECKING:
    from tinygrad import Tensor
    from tinygrad.uop.ops import UOp

__all__ = ["NUMERICS", "SERVING_NUMERICS", "ExpertCall", "KVCacheFull", "StageInput", "StageModel",
           "run_experts_in_graph", "run_numerics", "serving_numerics"]

# (first block, end block, cut): blocks [first, end) run; with `cut`, block end-1 stops after its router.
Segment = tuple[int, int, bool]
NUMERICS = ("float", "ggml")
# What `swarmd run` and served stages compute with: llama.cpp's arithmetic on GGML blocks (docs/BENCHMARKS.md,
# "Fidelity against llama.cpp": it follows llama.cpp's greedy tokens where float arithmetic does not).
SERVING_NUMERICS = "ggml"


def serving_numerics(config) -> str:
    """The arithmetic served stages and expert shards of a model use: `SERVING_NUMERICS`, but float for
    mixtures of experts (Llama-family expert shards compute in float16; DeepSeek-V3 / Kimi-K2 compute in float
    on their GGML blocks, as `swarmd run` does for them: `run_numerics`)."""
    return "float" if config.num_experts else SERVING_NUMERICS


def run_numerics(config) -> str:
    """The arithmetic `swarmd run` uses: `SERVING_NUMERICS`, but float for DeepSeek-V3 / Kimi-K2, so that a swarm
    serving one computes exactly what the single process does (llama.cpp's 8-bit activations moved their logits
    9-26 % of their range away from the float32 reference: docs/MOE.md, "One arithmetic")."""
    return "float" if is_mla(config) else SERVING_NUMERICS


def run_experts_in_graph(config) -> bool:
    """Whether `swarmd run` (and a served stage whose node holds its experts) runs a MoE's routed experts inside
    its graph: DeepSeek-V3 / Kimi-K2, where that gives the bits of a graph cut after each router (a swarm's) and
    decodes faster (docs/BENCHMARKS.md); a Llama-family MoE's graph is cut, as a swarm's is."""
    return is_mla(config)


@dataclass(frozen=True)
class StageInput:
    request_id: str
    start_pos: int  # position of data[0]; KV rows [start_pos, start_pos+T) are (over)written
    data: np.ndarray  # first stage: int token ids (T,); other stages: float32 hidden (T, hidden)
    all_logits: bool = False  # last stage only: (T, vocab) logits instead of the last position's (vocab,)
    # speculative verification: each row runs as a one-position decode step (the same kernels and reduction
    # order), all in the decode batch; the last stage returns (T, vocab) logits
    verify: bool = False
    # last stage, one position: its greedy token (an int32 array of shape ()) in place of the logits; a decode
    # batch picks it on the device, so the host neither reads nor scans the logits
    greedy: bool = False


def rope_table(config, rows: int, freq_factors: np.ndarray | None = None) -> np.ndarray:
    """(rows, rope_dim) float32: cos of each position's angles, then their sin (tinygrad.llm's layout)."""
    if is_mla(config):  # DeepSeek-V3 / Kimi-K2: YaRN where configured
        return deepseek2.rope_table(config, rows)
    half = config.rope_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(half, dtype=np.float64) * 2 / config.rope_dim))
    if freq_factors is not None:  # Llama 3 scaling: llama.cpp divides each frequency by its factor
        inv_freq = inv_freq / freq_factors.astype(np.float64)
    angles = np.arange(rows, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.concatenate([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)


@contextlib.contextmanager
def _layers_without_random_init() -> Iterator[None]:
    """tinygrad's nn layers draw random initial weights, a graph of random-number kernels per tensor (about a
    quarter of a stage's load time on a CPU); the model's own weights replace every one, so make them empty."""
    from tinygrad import Tensor

    saved = {name: Tensor.__dict__[name] for name in ("uniform", "glorot_uniform")}

    def empty(*shape, dtype=None, **_) -> Tensor:
        return Tensor.empty(*shape, dtype=dtype)

    for name in saved:
        setattr(Tensor, name, staticmethod(empty))
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(Tensor, name, method)


def _fuse(layers: list, quantized: list[BlockQuantized | None]) -> tuple[Tensor, BlockQuantized | None]:
    """Concatenate the layers' weight matrices into one and make each layer's weight a view of it: one
    matvec then reads Q, K and V (or gate and up) in one pass, and the GGUF-named weights stay.
    Matrices quantised alike are fused as blocks; a mix falls back to float16. Returns the fused matrix
    and its GGML blocks (None when it is dense)."""
    blocks = None
    if all(q is not None for q in quantized) and len({q.kind for q in quantized}) == 1:
        blocks = BlockQuantized.cat(quantized)  # type: ignore[arg-type]
        fused = blocks.dequantized()
    else:
        fused = layers[0].weight.cat(*[layer.weight for layer in layers[1:]])
        fused = (fused.cast("float16") if any(q is not None for q in quantized) else fused).contiguous().realize()
    row = 0
    for layer in layers:
        n = layer.weight.shape[0]
        layer.weight = fused[row:row + n]
        row += n
    return fused, blocks


def _dtype_name(w: Tensor | BlockQuantized) -> str:
    if isinstance(w, BlockQuantized):
        return "quantized"
    return {"half": "float16", "float": "float32"}.get(w.dtype.name, w.dtype.name)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Half-split RoPE, as tinygrad.llm.model.apply_rope, with angles broadcast over heads."""
    x1, x2 = x.chunk(2, dim=-1)
    return (x1 * cos - x2 * sin).cat(x2 * cos + x1 * sin, dim=-1)


class StageModel:
    """Blocks [start, end) of a model; embeds on the first stage, produces logits on the last."""

    def __init__(self, config, weights: dict[str, Tensor | BlockQuantized], start: int, end: int, *,
                 max_context: int = 2048,
                 max_requests: int = 8, device: str | None = None, prefill_chunk: int = 32,
                 attention_tile: int | None = None, local_experts: bool = True, numerics: str = "float",
                 source: str = "", reuse: StageModel | None = None, held: StageParts | None = None,
                 experts_in_graph: bool = False):
        """`weights`: GGUF name -> tensor of everything the stage holds (its routed experts are taken out of it, so
        that they are not held twice while stacked), but the parts `held` it takes over
        from `reuse` (by default all that `reuse.parts_for(...)` allows: the realised blocks both hold, and the
        embedding / head when both have it, shared, not copied). `source` names where the weights came from
        (file and dtype, or seed), so that only a stage of the same weights hands its parts over.
        `experts_in_graph`: a MoE stage holding its routed experts runs them inside its own graph (no host round
        trip per MoE block: the fast path on GPUs) instead of through its shard as a swarm does; for DeepSeek-V3 /
        Kimi-K2 on the CPU with the same bits (a Llama-family MoE's logits differ: docs/BENCHMARKS.md)."""
        from tinygrad import Device, Tensor, nn
        from tinygrad.llm.model import MLATransformerBlock, TransformerBlock

        if not 0 <= start < end <= config.num_blocks:
            raise ModelError(f"bad block range [{start}, {end}) for a model of {config.num_blocks} blocks")
        if max_requests < 1 or max_context < 2:
            raise ModelError("a stage needs max_requests >= 1 and max_context >= 2")
        if numerics not in NUMERICS:
            raise ModelError(f"unknown numerics {numerics!r}: use one of {', '.join(NUMERICS)}")
        self.numerics = numerics
        self.device = Device.canonicalize(device)
        tune_cpu_renderer(self.device)
        self.start, self.end, self.n_blocks = start, end, end - start
        self.is_first, self.is_last = start == 0, end == config.num_blocks
        self.max_context, self.max_requests, self.prefill_chunk = max_context, max_requests, prefill_chunk
        self.on_gpu = on_gpu = self.device.split(":")[0] in GPU_DEVICES
        if self.device.split(":")[0] == "CUDA":
            from models.tinygrad_ext.cuda_graph import fix_symbolic_launch_dims

            fix_symbolic_launch_dims()
        # decode attention over whole tiles of the cache (models.kernels.attention); on by default on GPUs
        self.attention_tile = (128 if on_gpu else 0) if attention_tile is None else attention_tile
        # a prompt's first chunk compiled with its start fixed at 0 (concrete lengths: faster GPU kernels; the
        # CPU keeps one graph, and its arithmetic, for every chunk)
        self.first_chunk_graph = on_gpu
        self.config = replace(config, max_context=max_context)
        self.hidden_size, self.vocab_size = config.dim, config.vocab_size
        self.moe_blocks = [i for i in range(start, end) if is_moe_block(config, i)]
        self.local_experts = local_experts or not self.moe_blocks
        # a stage runs its own routed experts through an ExpertShard, as a swarm's expert holders do, so that one
        # process and a swarm compute them alike: the graph cut after each router, or (`experts_in_graph`) the
        # shard's kernels inside the graph (tinygrad.llm's in-graph experts round differently and turn near-ties
        # into other tokens)
        self.mla = is_mla(config)
        # decode attention in one hand-written kernel a step (grouped-query attention in ggml numerics, on the CPU)
        self._cpu_attention = not self.mla and cpu_attention_fits(self.device, numerics)
        self.shards_experts = bool(self.moe_blocks) and self.local_experts
        self.experts_in_graph = experts_in_graph and self.shards_experts
        self.source = source
        if held is None:
            held = StageParts() if reuse is None else reuse.parts_for(
                config, start, end, source=source, device=self.device, numerics=numerics, local_experts=local_experts)
        self.reused = held  # what was taken over from `reuse` (nothing was read for it)
        self.weight_dtype = reuse._block_dtype(start) if reuse is not None and start in held.blocks \
            else _dtype_name(weights[self._probe_weight(start)])

        with _layers_without_random_init():
            block_class = MLATransformerBlock if self.mla else TransformerBlock
            self.blk = {i: reuse.blk[i] if reuse is not None and i in held.blocks
                        else block_class(block_config(self.config, i)) for i in range(start, end)}
            if self.is_first:
                self.token_embd = reuse.token_embd if reuse is not None and held.embedding \
                    else nn.Embedding(config.vocab_size, config.dim)
            if self.is_last:
                if reuse is not None and held.head:
                    self.output_norm, self.output = reuse.output_norm, reuse.output
                else:
                    self.output_norm = nn.RMSNorm(config.dim, config.norm_eps)
                    self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.expert_shard: ExpertShard | None = None  # the stage's own routed experts, when it shards them
        if self.shards_experts:  # taken out of the caller's dict, and out of `routed` layer by layer as stacked
            routed = {k: weights.pop(k) for k in list(weights) if k.endswith(ROUTED_WEIGHTS)}
            self.expert_shard = ExpertShard(self.config, routed, {i: range(config.num_experts) for i in self.moe_blocks},
                                            self.device, numerics)
        weights = dict(weights)
        factors = weights.pop("rope_freqs.weight", None)
        # quantised matrices enter the blocks as lazy dequantisation graphs over their codes, dense ones
        # as realised buffers; either way under their GGUF names
        quantized = {k: v for k, v in weights.items() if isinstance(v, BlockQuantized)}
        dense = {k: v.to(self.device).contiguous() for k, v in weights.items() if not isinstance(v, BlockQuantized)}
        if dense:  # none when every part is taken over
            Tensor.realize(*dense.values())
        loaded = dense | {k: v.dequantized() for k, v in quantized.items()}
        if self.mla:  # a stack held as (rows, last dimension) enters its block in its own shape
            loaded = {k: v.reshape(quantized[k].shape) if k in quantized and quantized[k].shape else v
                      for k, v in loaded.items()}
        if self.is_last and held.embedding and not held.head and "output.weight" not in loaded:  # tied to it
            loaded["output.weight"] = self.token_embd.weight
        # a stage whose experts live elsewhere loads no routed expert (they stay unrealised placeholders)
        nn.state.load_state_dict(self._weight_holders(but=held), loaded, verbose=False, realize=False,
                                 strict=self.local_experts and not self.shards_experts)
        self._qkv, self._gate_up = {}, {}
        # matrices in GGML blocks by GGUF name (fused ones as blk.{i}.qkv / gate_up), for ggml numerics
        self._blocks: dict[str, BlockQuantized] = dict(quantized)
        if reuse is not None:
            self._take_over(reuse, held)
            tied = self.is_last and held.embedding and not held.head and "output.weight" not in weights
            if tied and "token_embd.weight" in self._blocks:
                self._blocks["output.weight"] = self._blocks["token_embd.weight"]
        for i, blk in self.blk.items():
            if i in held.blocks:
                continue
            projections = (("attn_q_a" if self.config.q_lora_rank else "attn_q", "attn_kv_a_mqa") if self.mla
                           else ("attn_q", "attn_k", "attn_v"))  # the projections of the normed input, fused
            self._qkv[i], qkv = _fuse([getattr(blk, n) for n in projections],
                                      [quantized.get(f"blk.{i}.{n}.weight") for n in projections])
            gate_up, ffn = None, ("ffn_gate", "ffn_up")
            if i in self.moe_blocks:  # on GPUs a latent-attention block's shared expert reads gate and up in one product
                ffn = ("ffn_gate_shexp", "ffn_up_shexp") if on_gpu and self.mla and config.shared_expert_dim else ()
            if ffn:
                self._gate_up[i], gate_up = _fuse([getattr(blk, n) for n in ffn],
                                                  [quantized.get(f"blk.{i}.{n}.weight") for n in ffn])
            self._blocks.update({f"blk.{i}.{n}": b for n, b in (("qkv", qkv), ("gate_up", gate_up)) if b is not None})

        freq_factors = None if factors is None else factors.float().numpy()
        # a prefill chunk's padding rows, and the last attention tile, may reach past the context
        tiled = self._most_tiles() * self.attention_tile
        pad = max(prefill_chunk, tiled - max_context)
        rows = max_context + pad
        self._rope = Tensor(rope_table(self.config, rows, freq_factors), device=self.device).realize()
        self._positions = Tensor.arange(rows, device=self.device).realize()
        kv_dtype = "float16" if numerics == "ggml" else "float32"
        self.kv = LatentPool(range(start, end), max_requests, config.kv_lora_rank + config.rope_dim, max_context,
                             self.device, pad_rows=pad, dtype=kv_dtype) if self.mla else \
            KVPool(range(start, end), max_requests, config.n_kv_heads, max_context, config.head_dim,
                   self.device, pad_rows=pad, dtype=kv_dtype)
        self.slots = SlotTable(max_requests)
        self._inputs = HeldInputs(self.device)
        self._new_graphs()

    def _new_graphs(self) -> None:
        """The stage's segments as its experts say, and no graph captured yet."""
        # (batch, _segment_graph key, slot span: models.kernels.attention)
        self._decode_jits: dict[tuple[int, Any, int], cached_graphs.StoringJit] = {}
        # (all logits, _segment_graph key), then "first" for a prompt's first chunk's own graph
        self._prefill_jits: dict[tuple, cached_graphs.StoringJit] = {}
        self.segments = self._cut_segments()
        self._shared: dict[Segment, tuple[tuple, tuple[Tensor, ...]]] | None = None  # made on first use
        self._held_blocks: dict[bool, dict[int, tuple[list[str], list[UOp]]]] = {}  # see _block_buffers
        self._block_owned: set[UOp] | None = None  # cached_graphs.block_owned(self), found once
        self._unshared: set[tuple] = set()  # shared graphs that turned out to read a block's buffer of their own
        self.graphs = cached_graphs.for_stage(self)  # jitted graphs: from the graph cache, or captured and stored

    # ----- construction -----

    @classmethod
    def from_gguf(cls, path: str | Path, start: int = 0, end: int | None = None, *, max_context: int = 2048,
                  max_requests: int = 8, device: str | None = None, dtype: str | None = None,
                  numerics: str = "float", local_experts: bool = True, reuse: StageModel | None = None,
                  experts_in_graph: bool = False, attention_tile: int | None = None) -> StageModel:
        """Load blocks [start, end) (default: to the last block) of a GGUF model, reading only their bytes.

        `dtype`: "float16" (as tinygrad.llm; the default with float numerics but for `deepseek2`), "float32" (to measure what
        float16 costs), or "quantized" (the default, and the only choice, with ggml numerics): Q4_0/Q4_1/
        Q8_0 matrices stay in their GGML blocks and are dequantised inside the kernels (exact, ~2.8x
        smaller, faster on CPU; see docs/BENCHMARKS.md). `numerics`: see the module docstring;
        `SERVING_NUMERICS` is what `swarmd run` and served stages use.
        `local_experts=False`: the routed experts of MoE blocks are not loaded (see `forward_steps`).
        `reuse`: a stage loaded from the same file alike; the blocks both hold (and the embedding / head
        both have) are taken over from it as they are, shared, and not read again. `attention_tile`: as the
        constructor's (decode attention over whole tiles of that many cache rows; default 128 on GPUs)."""
        from tinygrad import Device

        from models.config import config_from_header
        from models.gguf.header import read_header
        from models.gguf.loader import load_stage_weights

        header = read_header(path)
        config = config_from_header(header, max_context)
        end = config.num_blocks if end is None else end
        if not 0 <= start < end <= config.num_blocks:
            raise ModelError(f"bad block range [{start}, {end}) for a model of {config.num_blocks} blocks")
        if dtype is None:  # DeepSeek-V3 / Kimi-K2 keep their GGML blocks whatever the arithmetic
            dtype = "quantized" if numerics == "ggml" or is_mla(config) else "float16"
        if numerics == "ggml" and dtype != "quantized":
            raise ModelError(f"numerics 'ggml' computes on GGML blocks: use dtype 'quantized', not {dtype!r}")
        source = f"gguf {Path(path).resolve()} {dtype}"
        held = None if reuse is None else reuse.parts_for(config, start, end, source=source, numerics=numerics,
                                                          device=Device.canonicalize(device), local_experts=local_experts)
        weights = load_stage_weights(header, config, start, end, device=device, dtype=dtype, routed=local_experts,
                                     held=held)
        return cls(config, weights, start, end, max_context=config.max_context, max_requests=max_requests,
                   device=device, local_experts=local_experts, numerics=numerics, source=source, reuse=reuse,
                   held=held, experts_in_graph=experts_in_graph, attention_tile=attention_tile)

    @classmethod
    def random(cls, config, seed: int, start: int = 0, end: int | None = None, *, dtype: str = "float16",
               reuse: StageModel | None = None, **kwargs: Any) -> StageModel:
        """A stage of a model with seeded random weights; block i's weights depend only on (seed, i), so
        any split of the model into stages gives the same model. `reuse`: as in `from_gguf`. MLA models
        (DeepSeek-V3 / Kimi-K2) are drawn as Q4_0 on the device (`models.catalog.seeded_quantized`)."""
        from tinygrad import Device

        end = config.num_blocks if end is None else end
        routed = kwargs.get("local_experts", True)
        dtype = "quantized" if is_mla(config) else dtype
        source = f"seed {seed} {dtype}"
        held = None if reuse is None else reuse.parts_for(
            config, start, end, source=source, device=Device.canonicalize(kwargs.get("device")),
            numerics=kwargs.get("numerics", "float"), local_experts=routed)
        if is_mla(config):
            from models.catalog import seeded_quantized

            weights = seeded_quantized.stage_weights(config, seed, start, end, kwargs.get("device"), routed=routed,
                                                     held=held)
        else:
            weights = random_weights(config, seed, start, end, dtype, kwargs.get("device"), routed=routed, held=held)
        return cls(config, weights, start, end, source=source, reuse=reuse, held=held, **kwargs)

    def _weight_holders(self, but: StageParts | None = None) -> dict[str, Any]:
        """The modules holding the weights, by GGUF name prefix; `but`'s parts left out."""
        but = but or StageParts()
        held: dict[str, Any] = {"blk": {i: b for i, b in self.blk.items() if i not in but.blocks}}
        if self.is_first and not but.embedding:
            held["token_embd"] = self.token_embd
        if self.is_last and not but.head:
            held.update(output_norm=self.output_norm, output=self.output)
        return held

    def parts_for(self, config, start: int, end: int, *, source: str, device: str, numerics: str,
                  local_experts: bool) -> StageParts:
        """What of this stage a stage [start, end) of the same weights can take over: the blocks both hold
        (MoE blocks only when both hold their routed experts, or neither), the embedding when both are first,
        the output norm and head when both are last. Nothing when the weights, device or numerics differ."""
        if (not source or source != self.source or device != self.device or numerics != self.numerics
                or replace(config, max_context=0) != replace(self.config, max_context=0)):
            return StageParts()
        both = range(max(start, self.start), min(end, self.end))
        blocks = frozenset(i for i in both if i not in self.moe_blocks
                           or (local_experts == self.local_experts and not self.shards_experts))
        return StageParts(blocks, start == 0 and self.is_first, end == config.num_blocks and self.is_last)

    def _take_over(self, other: StageModel, held: StageParts) -> None:
        """Point at `other`'s fused projections and GGML blocks of the parts in `held` (its blocks,
        embedding and head are already this stage's)."""
        for i in held.blocks:
            self._qkv[i] = other._qkv[i]
            if i in other._gate_up:
                self._gate_up[i] = other._gate_up[i]
        prefixes = tuple(f"blk.{i}." for i in held.blocks)
        names = {"token_embd.weight"} if held.embedding else set()
        names |= {"output.weight", "output_norm.weight"} if held.head else set()
        self._blocks.update({k: b for k, b in other._blocks.items() if k.startswith(prefixes) or k in names})

    def _probe_weight(self, i: int) -> str:
        """The matrix whose storage `weight_dtype` reports: block i's Q projection (MLA: its latent projection)."""
        return f"blk.{i}.attn_kv_a_mqa.weight" if self.mla else f"blk.{i}.attn_q.weight"

    def _block_dtype(self, i: int) -> str:
        """What `weight_dtype` says for a stage starting at block i: how its Q projection is held."""
        name = self._probe_weight(i)
        return "quantized" if name in self._blocks else _dtype_name(getattr(self.blk[i], name.split(".")[2]).weight)

    def weight_bytes(self) -> int:
        """Bytes of the device buffers holding this stage's weights (each buffer counted once: fused
        projections, quantisation codes and scales, a tied head shared with the embedding)."""
        from tinygrad import nn
        from tinygrad.uop.ops import Ops

        buffers = {u: u.buffer.nbytes for t in nn.state.get_parameters(self._weight_holders())
                   for u in t.uop.toposort() if u.op is Ops.BUFFER}
        return sum(buffers.values()) + (self.expert_shard.weight_bytes() if self.shards_experts else 0)

    # ----- requests -----

    def add_request(self, request_id: str) -> None:
        """Reserve a KV slot for `request_id`; raises KVCacheFull when every slot is taken."""
        self.slots.add(request_id)

    def free_request(self, request_id: str) -> None:
        self.slots.free(request_id)

    def adopt_request(self, old_id: str, new_id: str, keep: int) -> None:
        """Carry `old_id`'s KV cache over to `new_id`, truncated to its first `keep` tokens: a moved request
        whose blocks stay here computes only the positions after them (`swarmd.inference.head.hop_local`)."""
        self.slots.adopt(old_id, new_id, keep)

    def rollback(self, request_id: str, length: int) -> None:
        """Drop the cache's positions from `length` on (a verify step's rejected drafts): rows past a request's
        length are never read, and the next step writes over them."""
        have = self.position(request_id)
        if not 0 <= length <= have:
            raise ModelError(f"request {request_id!r}: cannot roll back to {length} tokens; the cache holds {have}")
        self.slots.set_length(request_id, length)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.slots

    def position(self, request_id: str) -> int:
        """How many tokens of `request_id` the cache holds."""
        return self.slots.length(request_id)

    def warmup(self, *, most_requests: int | None = None, prompt_scores: bool = True) -> None:
        """Compile and capture every jitted graph (prefill, and decode at each padded batch size up to
        `most_requests`, all by default; the prefill that scores the prompt too unless `prompt_scores` is
        False) with throwaway requests, so that first requests do not wait for tinygrad's compiler."""
        if len(self.slots):
            raise ModelError("warmup() needs a stage with no requests")
        row = np.zeros((2,), np.int64) if self.is_first else np.zeros((2, self.hidden_size), np.float32)
        most = self.max_requests if most_requests is None else min(most_requests, self.max_requests)
        sizes = sorted({self._bucket(n) for n in range(1, most + 1)})
        ids = [f"warmup-{b}" for b in range(self.max_requests)]

        def no_experts(call: ExpertCall) -> np.ndarray:
            return np.zeros_like(call.rows)

        answer = self.expert_shard if self.expert_shard is not None else no_experts  # its own experts warm too

        try:
            self.add_request(ids[0])
            for all_logits in (False, True) if self.is_last and prompt_scores else (False,):
                self.forward([StageInput(ids[0], 0, row, all_logits=all_logits)], experts=answer)  # captures
                if self.first_chunk_graph:  # that was a first chunk's graph: the later chunks' too
                    self.forward([StageInput(ids[0], len(row), row, all_logits=all_logits)], experts=answer)
            for size in sizes:
                for rid in ids[:size]:
                    self.add_request(rid)
                self.forward([StageInput(rid, 0, row[:1]) for rid in ids[:size]], experts=answer)
                for rid in ids[:size]:
                    self.free_request(rid)
                if self._slot_span(range(size)):  # that batch attended in slot order: a verify step's rows do not
                    self.add_request(ids[0])
                    rows = np.zeros((size, *row.shape[1:]), row.dtype)
                    self.forward([StageInput(ids[0], 0, rows, verify=True)], experts=answer)
                    self.free_request(ids[0])
        finally:
            for rid in ids:
                self.free_request(rid)

    # ----- compute -----

    def forward(self, items: Sequence[StageInput], experts: ExpertFn | None = None) -> list[np.ndarray]:
        """Run the stage on each item; decode items (T == 1) run together as one batch. A stage whose
        routed experts live elsewhere calls `experts` for each MoE layer (see `forward_steps`)."""
        steps = self.forward_steps(items)
        experts = experts if experts is not None else self.expert_shard
        try:
            call = next(steps)
            while True:
                if experts is None:
                    raise ModelError("this stage's experts live elsewhere: pass forward() an experts function")
                call = steps.send(experts(call))
        except StopIteration as done:
            return done.value

    def forward_steps(self, items: Sequence[StageInput]) -> Generator[ExpertCall, np.ndarray, list[np.ndarray]]:
        """`forward` as a generator: yields an `ExpertCall` per MoE layer and step whose experts are not
        held here, and is resumed with its answer, (N, dim) float32; returns the outputs. Only the
        blocking compute happens inside, so a caller may resume it from any thread."""
        ids = [it.request_id for it in items]
        if len(set(ids)) != len(ids):
            raise ModelError("a request may appear only once per forward() call")
        for it in items:
            self._check(it)
        out: list[np.ndarray | None] = [None] * len(items)
        decodes = [i for i, it in enumerate(items) if len(it.data) == 1 or it.verify]
        for i, it in enumerate(items):
            if len(it.data) > 1 and not it.verify:
                out[i] = yield from self._prefill(it)
                if it.greedy:
                    out[i] = np.asarray(np.argmax(out[i]), np.int32)
        if decodes:
            results = yield from self._decode([items[i] for i in decodes])
            for i, res in zip(decodes, results, strict=True):
                out[i] = res
        for it in items:
            self.slots.set_length(it.request_id, it.start_pos + len(it.data))
        return [o for o in out if o is not None]

    def _check(self, it: StageInput) -> None:
        have = self.position(it.request_id)
        n = len(it.data)
        if n < 1:
            raise ModelError(f"request {it.request_id!r}: empty input")
        if not 0 <= it.start_pos <= have:
            raise ModelError(f"request {it.request_id!r}: start_pos {it.start_pos} is past its cache ({have} tokens)")
        if it.start_pos + n > self.max_context:
            raise ModelError(f"request {it.request_id!r}: {it.start_pos + n} tokens exceed the context of "
                             f"{self.max_context}")
        want = (n,) if self.is_first else (n, self.hidden_size)
        if it.data.shape != want:
            raise ModelError(f"request {it.request_id!r}: input shape {it.data.shape}, expected {want}")
        if self.is_first and not (np.issubdtype(it.data.dtype, np.integer)
                                  and 0 <= it.data.min() and it.data.max() < self.vocab_size):
            raise ModelError(f"request {it.request_id!r}: token ids must be integers in [0, {self.vocab_size})")
        if it.all_logits and not self.is_last:
            raise ModelError("all_logits is only meaningful on the last stage")
        if it.greedy and (not self.is_last or it.all_logits or it.verify):
            raise ModelError("greedy is only meaningful on the last stage, for one position's logits")

    def _input(self, rows: np.ndarray) -> Tensor:
        """`rows` on the device as the graphs take them: token ids as int32, hidden rows as float32."""
        return self._inputs(rows.astype(np.int32) if np.issubdtype(rows.dtype, np.integer) else rows.astype(np.float32))

    def can_run_in_graph(self, shard: ExpertShard | None) -> bool:
        """Whether `use_experts(shard)` would run the shard's experts inside this stage's graph: a stage loaded
        without its routed experts, and a shard (of this stage's numerics and device) holding every expert of each
        of the stage's MoE blocks."""
        every = tuple(range(self.config.num_experts))
        return (not self.shards_experts and bool(self.moe_blocks) and shard is not None
                and shard.numerics == self.numerics and shard.device == self.device
                and all(tuple(shard.holds(i)) == every for i in self.moe_blocks))

    def use_experts(self, shard: ExpertShard | None) -> bool:
        """For a stage loaded without its routed experts: run `shard`'s inside the stage's graph where
        `can_run_in_graph(shard)` (a plan that keeps experts with their stage), with the bits of a graph cut after
        each router (`ExpertShard.in_graph`) and no host round trip per MoE block; otherwise, or with None, cut the
        graph and ask for them (`forward_steps`). Graphs captured before a change are dropped. Returns whether the
        experts run in the graph."""
        if self.shards_experts:
            return self.experts_in_graph
        fits = self.can_run_in_graph(shard)
        # a stage without experts of its own holds a shard only while it runs the shard's experts
        if (shard if fits else None) is not self.expert_shard:
            self.expert_shard, self.experts_in_graph = (shard, True) if fits else (None, False)
            self._new_graphs()
        return fits

    def _cut_segments(self) -> list[Segment]:
        """The stage's blocks as jitted segments: one when the experts are local, else cut after each
        MoE block's router (the last segment may hold no block: it only adds the experts' answer and,
        on the last stage, runs the head)."""
        if not self.moe_blocks or self.experts_in_graph:
            return [(self.start, self.end, False)]
        segments, first = [], self.start
        for m in self.moe_blocks:
            segments.append((first, m + 1, True))
            first = m + 1
        return [*segments, (first, self.end, False)]

    def _segment_graph(self, seg: Segment) -> tuple[Any, tuple[Tensor, ...]]:
        """The key of segment `seg`'s graph and the block buffers that graph takes as inputs. A segment of one MoE
        block cut at its router (but the first stage's first, which embeds the tokens) shares its graph with the
        stage's other blocks alike, their buffers its inputs: one capture, not one per block. Any other segment
        has a graph of its own (key: the segment)."""
        if self._shared is None:
            from tinygrad import Tensor

            self._shared = {}
            for first, end, cut in self.segments:
                if cut and end - first == 1 and not (self.is_first and first == self.start):
                    self._shared[(first, end, cut)] = (("block", self._block_kind(first, experts=False)),
                                                       tuple(Tensor(u) for u in self._block_buffers(experts=False)[first][1]))
        shared = self._shared.get(seg)
        return (seg, ()) if shared is None or shared[0] in self._unshared else shared

    def _block_buffers(self, *, experts: bool) -> dict[int, tuple[list[str], list[UOp]]]:
        """Per block, its buffers' names and buffers (`cached_graphs.block_buffers`), found once."""
        if experts not in self._held_blocks:
            self._held_blocks[experts] = cached_graphs.block_buffers(self, experts=experts)
        return self._held_blocks[experts]

    def _block_kind(self, i: int, *, experts: bool) -> str:
        """What block i's graph depends on but its buffers (those of its experts in this stage's shard with
        `experts`): blocks of one kind compute alike on their own buffers."""
        names, buffers = self._block_buffers(experts=experts)[i]
        alike = repr((block_config(self.config, i), i in self.moe_blocks, names, [(u.dtype, u.arg) for u in buffers]))
        return hashlib.sha256(alike.encode()).hexdigest()[:16]

    def _through_blocks(self, first: int, end: int, x: Tensor, cut: bool, block: Callable[[int, Tensor, bool], Any]) -> Any:
        """x through blocks first..end-1, `block(i, x, cut)` building block i (with `cut` the last returns its
        router's outputs). While a graph is captured, a block of a kind built before in this graph records that
        block's calls again on its own buffers (`RecordedCalls`) instead of being built: the graph building and
        scheduling of one block per kind, not of every block. The last block is built, so that its output flows
        into what follows unstored, as it would (a GPU compiler may fuse its last sum with what reads it). A
        recorded block whose calls read a block's buffer that is not among its own (`_block_buffers`) is not
        repeated."""
        recorded: dict[str, tuple[RecordedCalls, list[UOp], UOp, Any] | None] = {}
        for i in range(first, end):
            x = x.realize()
            kind = self._block_kind(i, experts=True) if capturing() and i < end - 1 else None
            if kind is None or recorded.get(kind, ...) is None:
                x = block(i, x, cut and i == end - 1)
                continue
            if kind in recorded:
                calls, params, xin, out = recorded[kind]
                mine = self._block_buffers(experts=True)[i][1]
                x = calls.again({**dict(zip(params, mine, strict=True)), xin: x.uop.base}, out)
                continue
            xin, params = x.uop.base, self._block_buffers(experts=True)[i][1]
            out, calls = RecordedCalls.record(functools.partial(block, i, x, False))
            if self._block_owned is None:
                self._block_owned = cached_graphs.block_owned(self)
            only_its_own = (calls.buffers() & self._block_owned) <= set(params)
            recorded[kind] = (calls, params, xin, out) if only_its_own else None
            x = out
        return x

    def _verify_shared(self, graph: Any) -> Callable[[Any], bool] | None:
        """For a shared graph: the check that it reads no block's buffer but through its inputs."""
        return functools.partial(cached_graphs.reads_no_block_buffer, self) if graph[0] == "block" else None

    def _run_segments(self, rows: np.ndarray, n_real: int, jit_of, args) -> Generator[ExpertCall, np.ndarray, Any]:
        """Run the segments in turn on `rows`; after a cut, ask for the layer's experts on the first
        `n_real` rows and add their answer to the residual stream. Returns the last graph's output on the device,
        or the rows (numpy) when the stage ends at a cut."""
        res: Any = rows
        for seg in self.segments:
            first, end, cut = seg
            if first == end and not self.is_last:
                continue  # nothing to run: the residual stream (with the experts' answer) is the output
            graph, buffers = self._segment_graph(seg)
            jit = jit_of(seg, graph)
            res = jit.replay(seg, (self._input(rows), *args, *buffers))
            if jit.refused:  # it holds this block's own buffers (computed right for it): every block gets its own
                self._unshared.add(graph)
                for jits in (self._decode_jits, self._prefill_jits):
                    for key in [k for k in jits if k[1] == graph]:
                        del jits[key]
            if not cut:
                continue
            x, normed, gates, sel = (read_back(t) for t in res)
            answer = yield ExpertCall(end - 1, normed[:n_real].copy(), sel[:n_real].astype(np.int32),
                                      gates[:n_real].astype(np.float32))
            rows = x.copy()
            rows[:n_real] += answer
            res = rows
        return res

    def _decode(self, items: list[StageInput]) -> Generator[ExpertCall, np.ndarray, list[np.ndarray]]:
        # one batch row per position: a verify item's rows share its slot, at consecutive positions (each row
        # stores its K/V before any row reads the cache, so a row sees the rows before it, as in decode steps)
        real = [(it, j) for it in items for j in range(len(it.data))]
        batch = self._bucket(len(real))
        pad = batch - len(real)
        rows = np.stack([it.data[j] for it, j in real] + [np.zeros_like(items[0].data[0])] * pad)
        slots = [self.slots.slot(it.request_id) for it, _ in real] + [self.kv.scratch_slot] * pad
        starts = [it.start_pos + j for it, j in real] + [0] * pad
        svars = [Bind(f"slot{b}", 0, self.kv.scratch_slot, s) for b, s in enumerate(slots)]
        pvars = [Bind(f"pos{b}", 0, self.max_context - 1, p) for b, p in enumerate(starts)]
        tile = self.attention_tile
        span = self._slot_span(slots[:len(real)])
        if span:  # the whole tiles that hold the batch's longest cache
            tvars = [Bind("tiles", 1, self._most_tiles(), max(starts) // tile + 1)]
        else:
            tvars = [Bind(f"tiles{b}", 1, self._most_tiles(), p // tile + 1)
                     for b, p in enumerate(starts)] if tile else []

        def jit_of(seg: Segment, graph: Any) -> cached_graphs.StoringJit:
            key = (batch, graph, span)
            if key not in self._decode_jits:
                self._decode_jits[key] = self.graphs.jit(("decode", batch, graph) + (("span", span) if span else ()),
                                                         functools.partial(self._decode_step, seg, span=span),
                                                         self._verify_shared(graph))
            return self._decode_jits[key]

        res = yield from self._run_segments(rows, len(real), jit_of, [*svars, *pvars, *tvars])
        # the last stage gives each request's logits (vocab,), (T, vocab) when verifying, or its greedy pick; the
        # others its hidden states (T, hidden): views of rows of arrays made for this step (no other holder writes them)
        if self.is_last:  # each read back only where an item needs it
            logits_t, picks_t = res
            greedy = [it.greedy for it in items]
            picks = read_back(picks_t) if any(greedy) else None
            res = None if all(greedy) else read_back(logits_t)
        elif not isinstance(res, np.ndarray):
            res = read_back(res)
        out, b = [], 0
        for it in items:
            n = len(it.data)
            if it.greedy:
                out.append(picks[b:b + 1].reshape(()))
            else:
                out.append(res[b] if self.is_last and not it.verify else res[b:b + n])
            b += n
        return out

    def _slot_span(self, held: Sequence[int]) -> int:
        """The slots [0, span) a decode batch's rows, held in `held` slots, attend over in slot order (one set of
        kernels: models.kernels.attention); 0 for a set of kernels per row: without tiles, with latent attention,
        for a lone row, or for rows that share a slot (a verify step's)."""
        if not self.attention_tile or self.mla or len(held) < 2 or len(set(held)) < len(held) or not slot_ordered():
            return 0
        return slot_span(held, self.max_requests)

    def _most_tiles(self) -> int:
        """The whole attention tiles that hold a full context; 0 without tiles."""
        return -(-self.max_context // self.attention_tile) if self.attention_tile else 0

    def _bucket(self, n: int) -> int:
        """Decode batches are padded to a power of two (capped at max_requests, unless verify rows make more):
        few shapes to compile."""
        size = 1 << (n - 1).bit_length()
        return min(size, self.max_requests) if n <= self.max_requests else size

    def _prefill(self, it: StageInput) -> Generator[ExpertCall, np.ndarray, np.ndarray]:
        chunk, n, slot = self.prefill_chunk, len(it.data), self.slots.slot(it.request_id)

        def jit_of(seg: Segment, graph: Any) -> cached_graphs.StoringJit:
            key = (it.all_logits, graph) + (("first",) if from_zero else ())
            if key not in self._prefill_jits:
                step = functools.partial(self._prefill_step, seg, all_logits=it.all_logits, from_zero=from_zero)
                self._prefill_jits[key] = self.graphs.jit(("prefill", *key), step, self._verify_shared(graph))
            return self._prefill_jits[key]

        svar = Bind("slot0", 0, self.kv.scratch_slot, slot)
        outs = []
        for lo in range(0, n, chunk):
            from_zero = self.first_chunk_graph and it.start_pos + lo == 0
            part = it.data[lo:lo + chunk]
            padded = np.concatenate([part, np.zeros((chunk - len(part), *part.shape[1:]), dtype=part.dtype)])
            sp = Bind("start", 0, self.max_context - 1, it.start_pos + lo)
            nt = Bind("ntok", 1, chunk, len(part))
            res = yield from self._run_segments(padded, len(part), jit_of, [svar, sp, nt])
            res = res if isinstance(res, np.ndarray) else read_back(res)
            outs.append(res[0].copy() if self.is_last and not it.all_logits else res[:len(part)].copy())
        if self.is_last and not it.all_logits:
            return outs[-1]
        return np.concatenate(outs)

    # ----- the jitted graphs -----

    def _decode_step(self, seg: Segment, inp: Tensor, *args: UOp | Tensor, span: int = 0) -> Tensor | tuple[Tensor, ...]:
        """`args`: the variables, then the block's buffers of a shared graph (the blocks read them as their own);
        `span`: the batch attends in slot order over slots [0, span) (0: a set of attention kernels per row)."""
        from tinygrad import Tensor

        first, end, cut = seg
        variables = [a for a in args if not isinstance(a, Tensor)]
        batch = inp.shape[0]
        slots, starts, tiles = variables[:batch], variables[batch:2 * batch], variables[2 * batch:]
        x = self.token_embd(inp).float() if self.is_first and first == self.start else inp
        x = x.reshape(batch, 1, self.hidden_size)
        angles = self._rope[starts[0]:starts[0] + 1]
        for p in starts[1:]:
            angles = angles.cat(self._rope[p:p + 1])
        # made once a step, for every block: written out (a view of the table, or a bound variable, is read in place
        # by tinygrad's kernels but copied out again before each hand-written kernel that reads it)
        angles = angles.reshape(batch, 1, 1, -1).contiguous().realize()
        at = None
        if batch > 1 or (self.mla and tiles) or self._cpu_attention:
            at = tuple(t.contiguous().realize() for t in batch_rows_at(slots, starts, self.device))
        x = self._through_blocks(first, end, x, cut, lambda i, h, cut: self._block(i, h, slots, starts, 1, angles, tiles, cut=cut, span=span, at=at))
        if cut:
            return tuple(t.reshape(batch, -1).realize() for t in x)
        if self.is_last:  # the logits and each row's greedy pick
            logits = self._head(self.output_norm(x).reshape(batch, -1)).realize()
            return logits, logits.argmax(axis=1).realize()
        return x.reshape(batch, self.hidden_size).realize()

    def _prefill_step(self, seg: Segment, inp: Tensor, slot: UOp, start: UOp | int, ntok: UOp, *_buffers: Tensor,
                      all_logits: bool, from_zero: bool = False) -> Tensor | tuple[Tensor, ...]:
        """One chunk of `prefill_chunk` rows, the first `ntok` real. The padding rows run too (a concrete
        row count compiles to ~3x faster kernels than a symbolic one); they come after the real rows,
        so the causal mask hides them, and the KV rows they write lie past the request's length, where
        every later step writes before it reads. `from_zero`: the chunk starts at position 0 (its `start` is
        not read), so its attention runs over a concrete length too."""
        first, end, cut = seg
        if from_zero:
            start = 0
        chunk = self.prefill_chunk
        x: Any = self.token_embd(inp).float() if self.is_first and first == self.start else inp
        x = x.reshape(1, chunk, self.hidden_size)
        angles = self._rope[start:start + chunk].reshape(1, 1, chunk, -1)
        x = self._through_blocks(first, end, x, cut, lambda i, h, cut: self._block(i, h, (slot,), (start,), chunk, angles, cut=cut))
        if cut:
            return tuple(t.reshape(chunk, -1).realize() for t in x)
        if not self.is_last:
            return x.reshape(chunk, self.hidden_size).realize()
        if not all_logits:
            x = x[:, ntok - 1:ntok]
        return self._head(self.output_norm(x).reshape(-1, self.hidden_size)).realize()

    def _head(self, h: Tensor) -> Tensor:
        # in row order on the device: a decode batch's product comes out transposed, and `read_back` would
        # transpose the logits on the host (tens of milliseconds at batch 32 and a 128k vocabulary)
        return self._matvec(h, self.output.weight, "output.weight").contiguous()

    def _matvec(self, h: Tensor, w: Tensor, name: str, glu: bool = False) -> Tensor:
        """h (rows, in) @ w.T; with `glu`, w is [gate | up] and the result silu(gate) * up (rows, out / 2), inside the
        product's kernel where that is `block_gemv`. With ggml numerics a matrix in GGML blocks multiplies 8-bit
        activations, as in llama.cpp."""
        blocks = self._blocks.get(name)
        if self.on_gpu and self.mla and blocks is not None and self.numerics != "ggml" \
                and h.shape[-1] % ggml_numerics.BLOCK == 0:  # GGML blocks in one split reduction
            return block_matvec(h.reshape(1, *h.shape), blocks, glu=glu)[0]
        if self.numerics == "ggml" and blocks is not None and h.shape[-1] % ggml_numerics.BLOCK == 0:
            y = ggml_numerics.matvec(h, w, blocks)
        elif blocks is not None and cpu_gemv_fits(h, blocks):
            y = cpu_gemv(h, blocks)  # rows on the CPU: each block decoded once for a tile of rows
        elif self.mla and self.numerics != "ggml" and float_gemv_fits(h, w):
            y = float_gemv(h, w)  # a float matrix (a router's): a kernel whose output the next one reads in place
        else:
            y = matvec(h, w)
        return silu_glu(y) if glu else y

    def _block(self, i: int, x: Tensor, slots: Sequence[UOp], starts: Sequence[UOp], T: int | UOp,
               angles: Tensor, tiles: Sequence[UOp] = (), *, cut: bool = False, span: int = 0,
               at: tuple[Tensor, Tensor] | None = None) -> Any:
        """One block for `len(slots)` requests of T tokens each: x (B, T, dim) -> (B, T, dim). With
        `cut` (a MoE block whose experts live elsewhere) it returns (residual with the shared experts
        added, FFN-normed input, gates, selected experts) instead. `at`: a decode batch's slots and positions as
        tensors (`batch_rows_at`): its rows' new cache rows are written in one kernel."""
        blk, c = self.blk[i], self.config
        batch = x.shape[0]

        def project(w: Tensor, h: Tensor, name: str, glu: bool = False) -> Tensor:
            """h (batch, T, in) times block i's matrix `name`; with `glu`, silu(gate) * up of a [gate | up] matrix."""
            out = self._matvec(h.reshape(batch * T, h.shape[-1]), w, f"blk.{i}.{name}", glu)
            return out.reshape(batch, T, w.shape[0] // (1 + glu))

        normed = self._norm(blk.attn_norm, x)
        if self.mla:
            attn = deepseek2.attention(self, i, normed, slots, starts, T, angles, project, tiles=tiles, at=at)
        else:
            attn = self._attention(i, normed, slots, starts, T, angles, tiles, project, span=span, at=at)
        h, normed = self._added_norm(blk.ffn_norm, x, attn)
        if i not in self.moe_blocks:
            return h + project(blk.ffn_down.weight, project(self._gate_up[i], normed, "gate_up", glu=True),
                               "ffn_down.weight")
        shared, shared_ffn = None, None
        if self.mla:  # the router and shared expert through the stage's matvec (GGML blocks stay blocks)
            logits = project(blk.ffn_gate_inp.weight, normed, "ffn_gate_inp.weight")
            gates, sel = route(blk, normed, c, logits=logits)
            shared_ffn = self._shared_ffn(i, normed)
            if c.shared_expert_dim and shared_ffn is None:
                if i in self._gate_up:
                    act = project(self._gate_up[i], normed, "gate_up", glu=True)
                else:
                    up = project(blk.ffn_up_shexp.weight, normed, "ffn_up_shexp.weight")
                    act = project(blk.ffn_gate_shexp.weight, normed, "ffn_gate_shexp.weight").silu() * up
                shared = project(blk.ffn_down_shexp.weight, act, "ffn_down_shexp.weight")
        else:
            gates, sel = route(blk, normed, c)
            shared = shared_experts(blk, normed)
        if self.experts_in_graph and not cut:  # the experts' sum adds the shared output too (one kernel fewer)
            return self.expert_shard.in_graph(i, normed, gates, sel, h, shared, shared_ffn)
        if shared_ffn is not None:
            shared = shared_expert(normed, *shared_ffn)
        if shared is not None:
            h = h + shared
        if cut:
            return h, normed, gates, sel
        return h + routed_experts(blk, normed, gates, sel)

    def _shared_ffn(self, i: int, x: Tensor) -> tuple[BlockQuantized, BlockQuantized] | None:
        """Block i's shared expert as GGML blocks ([gate | up], down) where `shared_expert` runs it for x (a GPU's
        float numerics), the same whether the experts run in the graph or it is cut; else None."""
        gate_up, down = self._blocks.get(f"blk.{i}.gate_up"), self._blocks.get(f"blk.{i}.ffn_down_shexp.weight")
        if not (self.on_gpu and self.numerics != "ggml" and gate_up is not None and down is not None):
            return None
        return (gate_up, down) if shared_expert_fits(x, gate_up, down) else None

    def _attention(self, i: int, x: Tensor, slots: Sequence[UOp], starts: Sequence[UOp], T: int | UOp,
                   angles: Tensor, tiles: Sequence[UOp], project, *, span: int = 0,
                   at: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """Block i's grouped-query attention of x (B, T, dim), attention-normed, through the requests' KV slots."""

        c, kv = self.config, self.kv.layers[i]
        batch = x.shape[0]
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        qkv = project(self._qkv[i], x, "qkv")
        if not self.on_gpu:  # one buffer (else tinygrad runs the product of several rows once for q, once for k and v)
            qkv = qkv.contiguous()
        q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)
        q = q.reshape(batch, T, c.n_heads, c.head_dim).transpose(1, 2)
        k = k.reshape(batch, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = v.reshape(batch, T, c.n_kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = angles.chunk(2, dim=-1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        # write each request's new rows into its own slot, then read its cache back through the writes
        cache = write_rows(kv, k.stack(v, dim=1), slots, starts, slot_axis=1, row_axis=3, at=at)
        tiling = {"tile": self.attention_tile, "positions": self._positions, "n_kv_heads": c.n_kv_heads}
        if span:  # a decode batch on a GPU in distinct slots: one set of kernels in slot order
            outs = [slot_ordered_decode_attention(q, cache, *at, tiles[0], span=span, **tiling)]
        elif tiles:  # a decode step on a GPU: each row over whole tiles of its cache
            outs = [tiled_decode_attention(q[b:b + 1], cache, s, p, t, **tiling)
                    for b, (s, p, t) in enumerate(zip(slots, starts, tiles, strict=True))]
        elif at is not None and self._cpu_attention:  # a decode step on the CPU: every row in one kernel
            outs = [cpu_decode_attention(q, cache, *at)]
        else:
            outs = [self._exact_attention(q[b:b + 1], cache, s, p, T) for b, (s, p) in enumerate(zip(slots, starts, strict=True))]
        attn = self.joined_rows(outs)
        return project(self.blk[i].attn_output.weight, attn.transpose(1, 2).reshape(batch, T, q_dim),
                       "attn_output.weight")

    def joined_rows(self, outs: list[Tensor]) -> Tensor:
        """The attention outputs of a batch's rows, one each, as one tensor. On a CPU each is written out first: joined
        lazily, they become one kernel that runs every row's sum for each output."""
        from tinygrad import Tensor

        if len(outs) == 1:
            return outs[0]
        return Tensor.cat(*(outs if self.on_gpu else [o.contiguous() for o in outs]))

    def _exact_attention(self, q: Tensor, cache: Tensor, slot: UOp, pos: UOp | int, T: int | UOp) -> Tensor:
        """One request's T tokens, q (1, heads, T, head_dim), over rows [0, pos + T) of its slot: causal within
        a prefill chunk; a decoded token attends to the whole cache. A prompt's first chunk on a GPU (concrete
        sizes) takes its products on the tensor cores (`half_product_attention`)."""
        from tinygrad import Tensor

        keys, values = cache[0, slot:slot + 1, :, 0:pos + T, :], cache[1, slot:slot + 1, :, 0:pos + T, :]
        mask = None
        if not (isinstance(T, int) and T == 1):
            mask = Tensor.full((1, 1, T, pos + T), float("-inf"), device=self.device, buffer=False).triu(pos + 1)
        if self.numerics == "ggml":
            return ggml_numerics.attention(q, keys, values, mask)
        if self.on_gpu and isinstance(pos, int) and isinstance(T, int) and T > 1 and half_products_on():
            return half_product_attention(q, keys, values, mask)
        if self.on_gpu:
            return q.scaled_dot_product_attention(keys, values, attn_mask=mask, enable_gqa=True)
        return grouped_query_attention(q, keys, values, mask)

    def _added_norm(self, norm, x: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:
        """x + delta and its RMSNorm: on NVIDIA GPUs with float numerics from one hand-written kernel
        (`models.kernels.rms_norm.added_rms_norm`)."""
        if self.numerics != "ggml" and added_norm_on() and rms_norm_fits(x, x.shape[-1]) \
                and all(isinstance(n, int) for n in delta.shape):
            return added_rms_norm(x, delta, norm.weight, norm.eps)
        h = x + delta
        if self.on_gpu:  # one buffer for the norm's kernel and the residual (else the kernel's input is a copy)
            h = h.contiguous()
        return h, self._norm(norm, h)

    def _norm(self, norm, x: Tensor, columns: tuple[int, int] | None = None) -> Tensor:
        """RMSNorm of x's last axis, or of a window (start, width) of it: on NVIDIA GPUs with float numerics in one
        hand-written kernel (`models.kernels.rms_norm`, reading the window in place); on other GPUs its sum of
        squares over a whole thread group (tinygrad gives it 16 threads).

        The group divides the width (256 for Llama widths; 64 for SmolLM2's 576; small test widths less)."""
        import math

        width = x.shape[-1] if columns is None else columns[1]
        if self.numerics != "ggml" and rms_norm_fits(x, width):
            return rms_norm(x, norm.weight, norm.eps, columns=columns)
        if columns is not None:
            x = x[..., columns[0]:columns[0] + width]
        group = math.gcd(256, width)
        if not self.on_gpu or group < 16:
            return norm(x)
        sq = gpu_reduce(lambda t: t.square().sum(-1, keepdim=True), (("GROUPTOP", 0, group),), x)
        return x * (sq / x.shape[-1] + norm.eps).rsqrt() * norm.weight
