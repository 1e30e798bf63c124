"""DeepSeek-V3 / Kimi-K2 blocks (GGUF architecture `deepseek2`) in a pipeline stage.

tinygrad.llm's `MLATransformerBlock` holds a block's weights under their GGUF names (`attn_q_a`,
`attn_q_a_norm`, `attn_q_b`, `attn_kv_a_mqa`, `attn_kv_a_norm`, `attn_k_b`, `attn_v_b`, `attn_output`,
and the MoE feed-forward of its `FFNBlock`); its attention is the absorbed form of multi-head latent
attention. What is written here is what a stage with a cache slot per request needs around those weights,
with the same arithmetic:

* `DeepSeek2Config`: tinygrad.llm's config (read from the metadata keys its `Transformer.from_gguf` reads)
  plus what it leaves out: YaRN RoPE scaling as llama.cpp applies it, and group-limited routing;
  `DeepSeek2Arch`: a release's numbers (`KIMI_K2`, `DEEPSEEK_V3`, and `KIMI_K2_MINI` at CPU scale);
* `attention`: one block's attention for the requests of a batch. Per token only the compressed latent is
  cached, the normalised kv_lora_rank values and the rope_dim rotated key values, in the request's slot of
  a `models.kv_cache.LatentPool`. Queries are absorbed into that space (q_nope times `attn_k_b`, for
  decode and prefill alike), so the cache is never decompressed; the latent-space output goes through
  `attn_v_b` per head, then `attn_output`;
* `rope_table`: the cos/sin table with YaRN's corrected frequencies and magnitude, and `kq_scale`.

RoPE: GGUF stores the rotated part of each query head (and of the key's rope part) in llama.cpp's
interleaved pairs; the loader permutes those rows to tinygrad's half-split form (as `Transformer.from_gguf`
does), so the rotation is tinygrad.llm's `apply_rope` layout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from models.errors import ModelError
from models.gguf.header import GGUFHeader
from models.kernels.block_gemv import Strided
from models.moe import GATING, MoEConfig

if TYPE_CHECKING:
    from tinygrad import Tensor
    from tinygrad.uop.ops import UOp

ARCH = "deepseek2"
GATING_FUNCS = {1: "softmax", 2: "sigmoid"}  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE


@dataclass(frozen=True)
class DeepSeek2Config(MoEConfig):
    """tinygrad.llm's `TransformerConfig` for MLA blocks (head_dim = qk_nope + qk_rope, `v_head_dim`,
    `q_lora_rank`, `kv_lora_rank`), with llama.cpp's YaRN scaling (`yarn_factor` 0: none)."""

    yarn_factor: float = 0.0
    yarn_original_context: int = 0
    yarn_beta_fast: float = 32.0  # llama.cpp's defaults
    yarn_beta_slow: float = 1.0
    yarn_log_multiplier: float = 0.0  # DeepSeek's mscale_all_dim (the file holds 0.1 times it)

    @property
    def qk_nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token and block: the compressed latent and the rotated key."""
        return self.kv_lora_rank + self.rope_dim


@dataclass(frozen=True)
class DeepSeek2Arch:
    """The numbers of a DeepSeek-V3-family release (its config.json's, by llama.cpp's names)."""

    name: str
    n_blocks: int
    dim: int
    n_heads: int
    q_lora: int
    kv_lora: int
    nope: int
    rope: int
    v_dim: int
    dense_ffn: int
    expert_ffn: int
    n_experts: int
    top_k: int
    n_shared: int
    leading_dense: int
    routed_scale: float
    groups: int = 1
    groups_used: int = 1
    theta: float = 50000.0
    eps: float = 1e-6
    context: int = 131072
    yarn_factor: float = 32.0
    yarn_original_context: int = 4096
    yarn_beta_fast: float = 1.0
    yarn_beta_slow: float = 1.0
    mscale_all_dim: float = 1.0

    def config(self, vocab: int, max_context: int | None = None) -> DeepSeek2Config:
        """The config a stage builds from a file of this architecture (as `config_from_header` reads it)."""
        return DeepSeek2Config(
            num_blocks=self.n_blocks, dim=self.dim, hidden_dim=self.expert_ffn, n_heads=self.n_heads,
            n_kv_heads=self.n_heads, norm_eps=self.eps, vocab_size=vocab, head_dim=self.nope + self.rope,
            rope_theta=self.theta, rope_dim=self.rope, v_head_dim=self.v_dim,
            max_context=min(max_context, self.context) if max_context else self.context,
            num_experts=self.n_experts, num_experts_per_tok=self.top_k, norm_topk_prob=True,
            q_lora_rank=self.q_lora, kv_lora_rank=self.kv_lora, shared_expert_dim=self.n_shared * self.expert_ffn,
            shared_expert_gate=False, leading_dense_blocks=self.leading_dense, dense_hidden_dim=self.dense_ffn,
            routed_scaling_factor=self.routed_scale, expert_bias=True, expert_gating="sigmoid",
            expert_groups=self.groups if self.groups > 1 else 0,
            expert_groups_used=self.groups_used if self.groups > 1 else 0,
            yarn_factor=self.yarn_factor, yarn_original_context=self.yarn_original_context,
            yarn_beta_fast=self.yarn_beta_fast, yarn_beta_slow=self.yarn_beta_slow,
            yarn_log_multiplier=self.mscale_all_dim)

# The releases' config.json numbers (hidden 7168, MLA ranks 1536 / 512, heads of 128 + 64 / 128, YaRN).
KIMI_K2 = DeepSeek2Arch("Kimi-K2", n_blocks=61, dim=7168, n_heads=64, q_lora=1536, kv_lora=512, nope=128, rope=64,
                        v_dim=128, dense_ffn=18432, expert_ffn=2048, n_experts=384, top_k=8, n_shared=1,
                        leading_dense=1, routed_scale=2.827)
DEEPSEEK_V3 = DeepSeek2Arch("DeepSeek-V3", n_blocks=61, dim=7168, n_heads=128, q_lora=1536, kv_lora=512, nope=128,
                            rope=64, v_dim=128, dense_ffn=18432, expert_ffn=2048, n_experts=256, top_k=8, n_shared=1,
                            leading_dense=3, routed_scale=2.5, groups=8, groups_used=4, theta=10000.0, context=163840,
                            yarn_factor=40.0, yarn_beta_fast=32.0)
# Kimi-K2 at a width and depth a 2-core CPU runs: the release's ratios at 1/16 of its width (hidden 448, q_lora 96,
# kv_lora 32, dense FFN 1152, expert FFN 128; 16 heads of Kimi's per-head proportions, 32 + 16 query/key values
# and 32 value values, so heads x v : hidden stays 8 : 7) and all of its structure: 384 routed experts, top-8, one
# shared expert, the first block dense, sigmoid routing with a selection bias, normalised gates scaled by 2.827,
# one expert group, YaRN (factor 32 over 4096 positions, beta 1/1, mscale_all_dim 1), RoPE base 50000, RMSNorm
# epsilon 1e-6; four blocks.
KIMI_K2_MINI = DeepSeek2Arch("Kimi-K2-mini", n_blocks=4, dim=448, n_heads=16, q_lora=96, kv_lora=32, nope=32, rope=16,
                             v_dim=32, dense_ffn=1152, expert_ffn=128, n_experts=384, top_k=8, n_shared=1,
                             leading_dense=1, routed_scale=2.827)
RELEASES = {"kimi-k2": KIMI_K2, "deepseek-v3": DEEPSEEK_V3}  # planner.arch names -> numbers


def is_mla(config: Any) -> bool:
    return getattr(config, "kv_lora_rank", 0) > 0


def _require(header: GGUFHeader, key: str) -> Any:
    full = f"{header.arch}.{key}"
    if full not in header.kv:
        raise ModelError(f"{header.path.name}: GGUF metadata lacks '{full}'; the file is incomplete or not a model")
    return header.kv[full]


def config_from_header(header: GGUFHeader, vocab: int, max_context: int | None = None) -> DeepSeek2Config:
    """The config of a `deepseek2` GGUF: the keys tinygrad.llm's `Transformer.from_gguf` reads for it
    (`key_length_mla`/`value_length_mla`, or the legacy `key_length`/`value_length`), llama.cpp's MoE keys
    with its defaults (softmax gating when `expert_gating_func` is absent), and its YaRN keys."""
    n_heads = int(_require(header, "attention.head_count"))
    kv_lora = int(_require(header, "attention.kv_lora_rank"))
    head_dim = int(header.arch_key("attention.key_length_mla", header.arch_key("attention.key_length", 0)))
    v_head_dim = int(header.arch_key("attention.value_length_mla", header.arch_key("attention.value_length", 0)))
    rope_dim = int(_require(header, "rope.dimension_count"))
    if not (0 < rope_dim < head_dim and v_head_dim > 0 and kv_lora > 0):
        raise ModelError(f"{header.path.name}: inconsistent MLA sizes (key length {head_dim}, value length "
                         f"{v_head_dim}, rope {rope_dim}, kv_lora_rank {kv_lora})")
    context = int(_require(header, "context_length"))
    n_experts = int(_require(header, "expert_count"))
    top_k = int(_require(header, "expert_used_count"))
    if not 1 <= top_k <= n_experts:
        raise ModelError(f"{header.path.name}: expert_used_count {top_k} is not in [1, {n_experts}]")
    gating = GATING_FUNCS.get(int(header.arch_key("expert_gating_func", 1)))
    if gating not in GATING:
        raise ModelError(f"{header.path.name}: expert_gating_func {header.arch_key('expert_gating_func')} is "
                         "not supported (1 softmax, 2 sigmoid)")
    groups, groups_used = int(header.arch_key("expert_group_count", 1)), int(header.arch_key("expert_group_used_count", 1))
    if groups > 1 and (n_experts % groups or not 1 <= groups_used <= groups):
        raise ModelError(f"{header.path.name}: {n_experts} experts in {groups} groups, {groups_used} used: inconsistent")
    expert_ffn = int(_require(header, "expert_feed_forward_length"))
    leading = int(header.arch_key("leading_dense_block_count", 0))
    yarn = {}
    if header.arch_key("rope.scaling.type") == "yarn":
        yarn = dict(yarn_factor=float(_require(header, "rope.scaling.factor")),
                    yarn_original_context=int(_require(header, "rope.scaling.original_context_length")),
                    yarn_beta_fast=float(header.arch_key("rope.scaling.yarn_beta_fast", 32.0)),
                    yarn_beta_slow=float(header.arch_key("rope.scaling.yarn_beta_slow", 1.0)),
                    yarn_log_multiplier=float(header.arch_key("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1)
    elif header.arch_key("rope.scaling.type", "none") not in ("none", None):
        raise ModelError(f"{header.path.name}: RoPE scaling {header.arch_key('rope.scaling.type')!r} is not "
                         "supported for deepseek2 (none or yarn)")
    return DeepSeek2Config(
        num_blocks=int(_require(header, "block_count")) - int(header.arch_key("nextn_predict_layers", 0)),
        dim=int(_require(header, "embedding_length")), hidden_dim=expert_ffn, n_heads=n_heads, n_kv_heads=n_heads,
        norm_eps=float(_require(header, "attention.layer_norm_rms_epsilon")), vocab_size=vocab, head_dim=head_dim,
        rope_theta=float(_require(header, "rope.freq_base")), rope_dim=rope_dim, v_head_dim=v_head_dim,
        max_context=min(max_context, context) if max_context else context,
        num_experts=n_experts, num_experts_per_tok=top_k, norm_topk_prob=bool(header.arch_key("expert_weights_norm", False)),
        q_lora_rank=int(header.arch_key("attention.q_lora_rank", 0)), kv_lora_rank=kv_lora,
        shared_expert_dim=int(header.arch_key("expert_shared_count", 0)) * expert_ffn,
        shared_expert_gate=f"blk.{leading}.ffn_gate_inp_shexp.weight" in header.tensors,
        leading_dense_blocks=leading, dense_hidden_dim=int(header.arch_key("feed_forward_length", 0)) if leading else 0,
        routed_scaling_factor=float(header.arch_key("expert_weights_scale", 1.0)),
        expert_bias=f"blk.{leading}.exp_probs_b.bias" in header.tensors, expert_gating=gating,
        expert_groups=groups if groups > 1 else 0, expert_groups_used=groups_used if groups > 1 else 0, **yarn)


# ----- tensors -----

def block_shapes(config: DeepSeek2Config, i: int) -> dict[str, tuple[int, ...]]:
    """GGUF name (without `blk.{i}.`) -> numpy shape of block i's tensors in the form llama.cpp's converter
    writes (split `attn_k_b`/`attn_v_b`), routed experts stacked."""
    from models.moe import block_config, is_moe_block

    c = block_config(config, i)
    h, hd, L, r = c.n_heads, c.head_dim, c.kv_lora_rank, c.rope_dim
    shapes: dict[str, tuple[int, ...]] = {"attn_norm.weight": (c.dim,)}
    if c.q_lora_rank:
        shapes |= {"attn_q_a.weight": (c.q_lora_rank, c.dim), "attn_q_a_norm.weight": (c.q_lora_rank,),
                   "attn_q_b.weight": (h * hd, c.q_lora_rank)}
    else:
        shapes["attn_q.weight"] = (h * hd, c.dim)
    shapes |= {"attn_kv_a_mqa.weight": (L + r, c.dim), "attn_kv_a_norm.weight": (L,),
               "attn_k_b.weight": (h, L, hd - r), "attn_v_b.weight": (h, c.v_head_dim, L),
               "attn_output.weight": (c.dim, h * c.v_head_dim), "ffn_norm.weight": (c.dim,)}
    if not is_moe_block(config, i):
        return shapes | {"ffn_gate.weight": (c.hidden_dim, c.dim), "ffn_up.weight": (c.hidden_dim, c.dim),
                         "ffn_down.weight": (c.dim, c.hidden_dim)}
    shapes["ffn_gate_inp.weight"] = (c.num_experts, c.dim)
    if c.expert_bias:
        shapes["exp_probs_b.bias"] = (c.num_experts,)
    e, f = c.num_experts, c.hidden_dim
    shapes |= {"ffn_gate_exps.weight": (e, f, c.dim), "ffn_up_exps.weight": (e, f, c.dim),
               "ffn_down_exps.weight": (e, c.dim, f)}
    if c.shared_expert_dim:
        s = c.shared_expert_dim
        shapes |= {"ffn_gate_shexp.weight": (s, c.dim), "ffn_up_shexp.weight": (s, c.dim),
                   "ffn_down_shexp.weight": (c.dim, s)}
    return shapes


# ----- RoPE with YaRN -----

def _mscale(factor: float, m: float) -> float:
    return 1.0 if factor <= 1.0 else 0.1 * m * math.log(factor) + 1.0


def yarn_scales(config: DeepSeek2Config) -> tuple[float, float]:
    """(magnitude of the rotated values, attention scale factor mscale) as llama.cpp computes them for
    deepseek2: the context's `yarn_attn_factor` (llama-context.cpp) cancels YaRN's own magnitude term when the
    file has a log multiplier; the graph's kq_scale multiplies 1/sqrt(head_dim) by mscale squared."""
    f, log_mul = config.yarn_factor, config.yarn_log_multiplier
    if f <= 0:
        return 1.0, 1.0
    if log_mul != 0.0:
        m = log_mul if log_mul != 1.0 else 1.0  # llama.cpp's deepseek2 special case: mscale = mscale_all_dim
        attn_factor = _mscale(f, m) / _mscale(f, log_mul)
    else:
        attn_factor = _mscale(f, 1.0)
    attn_factor /= 1.0 + 0.1 * math.log(f)
    magnitude = attn_factor * (1.0 + 0.1 * math.log(f))  # what ggml's rope_yarn multiplies cos and sin by
    return magnitude, magnitude * (1.0 + 0.1 * log_mul * math.log(f))


def kq_scale(config: DeepSeek2Config) -> float:
    return yarn_scales(config)[1] ** 2 / math.sqrt(config.head_dim)


def rope_table(config: DeepSeek2Config, rows: int) -> np.ndarray:
    """(rows, rope_dim) float32: cos of each position's angles, then their sin (tinygrad.llm's layout), with
    YaRN's ramp between interpolated and extrapolated frequencies (ggml's `rope_yarn`) when configured."""
    n, half = config.rope_dim, config.rope_dim // 2
    inv = config.rope_theta ** (-np.arange(half, dtype=np.float64) * 2 / n)
    magnitude = 1.0
    if config.yarn_factor > 0:
        def corr_dim(n_rot: float) -> float:
            return n * math.log(config.yarn_original_context / (n_rot * 2 * math.pi)) / (2 * math.log(config.rope_theta))

        low = max(0.0, math.floor(corr_dim(config.yarn_beta_fast)))
        high = min(n - 1.0, math.ceil(corr_dim(config.yarn_beta_slow)))
        ramp = 1 - np.clip((np.arange(half) - low) / max(0.001, high - low), 0, 1)  # 1: extrapolate
        inv = inv / config.yarn_factor * (1 - ramp) + inv * ramp
        magnitude = yarn_scales(config)[0]
    angles = np.arange(rows, dtype=np.float64)[:, None] * inv[None, :]
    return (np.concatenate([np.cos(angles), np.sin(angles)], axis=1) * magnitude).astype(np.float32)


# ----- the attention of a stage's block -----

def attention(stage: Any, i: int, h: Tensor, slots: Sequence[UOp], starts: Sequence[UOp], T: int | UOp,
              angles: Tensor, project, *, tiles: Sequence[UOp] = (), at: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Block i's multi-head latent attention for `len(slots)` requests of T tokens each: h (B, T, dim), the
    attention-normed input, -> (B, T, dim). `project(w, x, name)` is the stage's matvec over GGUF-named
    weights (8-bit activations before block-quantised products under ggml numerics). `tiles`: a decode step's
    whole cache tiles per row (GPUs, float numerics: `tiled_latent_attention`, or `latent_attention`'s kernels on
    NVIDIA GPUs). `at`: a decode batch's slots and positions as tensors, for writing its latents in one kernel
    (and for those kernels)."""
    from tinygrad import Tensor

    from models.kernels import ggml_numerics
    from models.kernels.attention import tiled_latent_attention
    from models.kernels.cache_rows import write_rows
    from models.kernels.latent_attention import (
        QueryRope,
        latent_attention,
        latent_attention_fits,
        query_rope_on,
    )
    from models.kernels.latent_rows import LatentNorms, latent_rows, latent_rows_fits

    blk, c, cache = stage.blk[i], stage.config, stage.kv.layers[i]
    batch, L, r, nope = h.shape[0], c.kv_lora_rank, c.rope_dim, c.qk_nope_dim
    ggml = stage.numerics == "ggml"
    q_width = c.q_lora_rank or c.n_heads * c.head_dim
    qkv = project(stage._qkv[i], h, "qkv")  # attn_q_a (or attn_q), attn_kv_a_mqa
    q, kv = qkv.split([q_width, L + r], dim=-1)
    scale, decode = kq_scale(c), isinstance(T, int) and T == 1
    cached = None  # the cache after this step's writes
    if tiles and decode and not ggml and at is not None and latent_rows_fits(qkv.reshape(batch, -1), cache,
                                                                            c.q_lora_rank, L, r):
        norms = LatentNorms(blk.attn_q_a_norm.weight, blk.attn_kv_a_norm.weight, blk.attn_q_a_norm.eps,
                            blk.attn_kv_a_norm.eps)  # both norms, the key's rotation and the write in one kernel
        q_normed, cached = latent_rows(qkv.reshape(batch, -1), norms, angles.reshape(batch, r), cache, *at,
                                       q_width=q_width)
        q = project(blk.attn_q_b.weight, q_normed.reshape(batch, T, q_width), "attn_q_b.weight")
    elif c.q_lora_rank:
        q = project(blk.attn_q_b.weight, stage._norm(blk.attn_q_a_norm, qkv, (0, q_width)), "attn_q_b.weight")
    q_heads = q  # (B, T, heads x head_dim) as the projection wrote it
    nope_in_place = Strided(q, c.head_dim, c.n_heads * c.head_dim, (c.n_heads, batch * T, nope)) \
        if isinstance(T, int) else None  # each head's first `nope` values where they lie
    q = q.reshape(batch, T, c.n_heads, c.head_dim).transpose(1, 2)  # (B, H, T, head_dim)
    cos, sin = angles.chunk(2, dim=-1)
    q_rope = _rotate(q[..., nope:], cos, sin)
    q_nope = q[..., :nope]
    if ggml and nope % ggml_numerics.BLOCK == 0:
        q_nope = ggml_numerics.q8_activations(q_nope.reshape(-1, nope))[0].reshape(batch, c.n_heads, T, nope)
    q_latent = _per_head(stage, i, q_nope, "attn_k_b", None if ggml else nope_in_place)  # (B, H, T, kv_lora): absorbed
    if cached is None:
        k_rope = _rotate(kv[..., L:].reshape(batch, 1, T, r), cos, sin)
        latent = stage._norm(blk.attn_kv_a_norm, qkv, (q_width, L)).reshape(batch, 1, T, L).cat(k_rope, dim=-1)
        # write each request's new latents into its own slot, then read its cache back through the writes
        cached = write_rows(cache, latent.reshape(batch, T, L + r), slots, starts, slot_axis=0, row_axis=1, at=at)
    query = q_latent.cat(q_rope, dim=-1)  # (B, H, T, L + r)
    if tiles and decode and not ggml:  # GPUs: the batch in hand-written kernels, or every row over whole tiles
        rows = query.reshape(batch, c.n_heads, L + r)
        if at is not None and latent_attention_fits(rows, cached, L):
            rope = QueryRope(q_heads.reshape(batch, c.n_heads, c.head_dim), nope, angles.reshape(batch, r)) \
                if query_rope_on() else None  # rotated in the kernel: no kernel joins the query first
            queries = q_latent.reshape(batch, c.n_heads, L) if rope else rows
            outs = [latent_attention(queries, cached, *at, values=L, scale=scale, rope=rope)
                    .reshape(batch, c.n_heads, 1, L)]
        else:
            tiling = {"tile": stage.attention_tile, "positions": stage._positions, "values": L, "scale": scale}
            outs = [tiled_latent_attention(query[b:b + 1], cached, s, p, t, **tiling)
                    for b, (s, p, t) in enumerate(zip(slots, starts, tiles, strict=True))]
    else:
        outs = []
        for b, (s, p) in enumerate(zip(slots, starts, strict=True)):
            keys = cached[s:s + 1, 0:p + T, :].float().reshape(1, 1, p + T, L + r)
            qb = ggml_numerics.round_f16(query[b:b + 1]) if ggml else query[b:b + 1]
            scores = qb @ keys.transpose(-1, -2) * scale  # (1, H, T, S)
            if not decode:  # causal within the chunk; a decoded token attends to the whole cache
                mask = Tensor.full((1, 1, T, p + T), float("-inf"), device=stage.device, buffer=False).triu(p + 1)
                scores = scores + mask
            probs = scores.softmax(-1)
            outs.append((ggml_numerics.round_f16(probs) if ggml else probs) @ keys[..., :L])  # (1, H, T, L)
    out = stage.joined_rows(outs)
    if ggml and L % ggml_numerics.BLOCK == 0:
        out = ggml_numerics.q8_activations(out.reshape(-1, L))[0].reshape(batch, c.n_heads, T, L)
    out = _per_head(stage, i, out, "attn_v_b")  # (B, H, T, v)
    return project(blk.attn_output.weight, out.transpose(1, 2).reshape(batch, T, c.n_heads * c.v_head_dim),
                   "attn_output.weight")


def _per_head(stage: Any, i: int, x: Tensor, name: str, lying: Strided | None = None) -> Tensor:
    """x (B, H, T, in) times block i's per-head matrices `name` (H, out, in) -> (B, H, T, out): on NVIDIA GPUs, with
    float numerics and a few rows, `block_gemv` reads the heads' GGML blocks once for all rows, and x's values
    where they lie when `lying` says where (head h's row b * T + t at h * `lying.slot` + (b * T + t) * `lying.row`)."""
    from models.kernels.block_gemv import block_gemv, block_gemv_fits, heads_in_place_on

    blocks = stage._blocks.get(f"blk.{i}.{name}.weight")
    batch, heads, T, width = x.shape
    if blocks is not None and stage.numerics != "ggml" and isinstance(T, int):
        rows = x.permute(1, 0, 2, 3).reshape(heads, batch * T, width)
        if block_gemv_fits(rows, blocks, gathered=False):
            if lying is not None and not (lying.aligned and heads_in_place_on()):
                lying = None
            return block_gemv(lying or rows, blocks).reshape(heads, batch, T, -1).permute(1, 0, 2, 3)
    return x @ getattr(stage.blk[i], name)["weight"].float().transpose(-1, -2)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Half-split RoPE, as tinygrad.llm.model.apply_rope, with angles broadcast over heads."""
    x1, x2 = x.chunk(2, dim=-1)
    return (x1 * cos - x2 * sin).cat(x2 * cos + x1 * sin, dim=-1)
