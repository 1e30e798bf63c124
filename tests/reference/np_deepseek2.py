"""An independent float32 numpy DeepSeek-V3 / Kimi-K2 (GGUF architecture `deepseek2`), the reference the
tinygrad stages are tested against (tests only).

Nothing here comes from tinygrad or from `models/`: gguf-py reads and dequantises the weights, and the
attention is multi-head latent attention in its plain (non-absorbed) form: each head's keys and values
are decompressed from the cached latent (`attn_kv_b`, or `attn_k_b`/`attn_v_b` put back together), RoPE
rotates adjacent pairs of GGUF's own layout as llama.cpp does, with YaRN's ramp and scales as ggml computes
them. Routing: sigmoid or softmax scores, selection bias, group-limited top-k, normalised gates, routed
scaling; shared experts; leading dense blocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class NpDeepSeek2:
    n_blocks: int
    dim: int
    n_heads: int
    q_lora: int
    kv_lora: int
    nope: int
    rope: int
    v_dim: int
    eps: float
    theta: float
    n_experts: int
    top_k: int
    groups: int
    groups_used: int
    gating: str
    norm_topk: bool
    routed_scale: float
    leading_dense: int
    yarn_factor: float = 0.0
    yarn_orig: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    yarn_log_mul: float = 0.0


def load(path: str | Path) -> tuple[NpDeepSeek2, dict[str, np.ndarray]]:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))

    def field(key: str, default=None):
        f = reader.fields.get(f"deepseek2.{key}")
        if f is None:
            return default
        value = f.contents()
        return value

    weights = {t.name: np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(
        tuple(reversed([int(d) for d in t.shape]))) for t in reader.tensors}
    head = field("attention.key_length_mla", field("attention.key_length"))
    rope = field("rope.dimension_count")
    yarn = {}
    if field("rope.scaling.type") == "yarn":
        yarn = dict(yarn_factor=field("rope.scaling.factor"), yarn_orig=field("rope.scaling.original_context_length"),
                    beta_fast=field("rope.scaling.yarn_beta_fast", 32.0), beta_slow=field("rope.scaling.yarn_beta_slow", 1.0),
                    yarn_log_mul=field("rope.scaling.yarn_log_multiplier", 0.0) / 0.1)
    config = NpDeepSeek2(
        n_blocks=field("block_count"), dim=field("embedding_length"), n_heads=field("attention.head_count"),
        q_lora=field("attention.q_lora_rank", 0), kv_lora=field("attention.kv_lora_rank"), nope=head - rope, rope=rope,
        v_dim=field("attention.value_length_mla", field("attention.value_length")),
        eps=field("attention.layer_norm_rms_epsilon"), theta=field("rope.freq_base"), n_experts=field("expert_count"),
        top_k=field("expert_used_count"), groups=field("expert_group_count", 1), groups_used=field("expert_group_used_count", 1),
        gating={1: "softmax", 2: "sigmoid"}[field("expert_gating_func", 1)], norm_topk=bool(field("expert_weights_norm", False)),
        routed_scale=field("expert_weights_scale", 1.0), leading_dense=field("leading_dense_block_count", 0), **yarn)
    return config, weights


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope(x: np.ndarray, positions: np.ndarray, c: NpDeepSeek2) -> np.ndarray:
    """Rotate adjacent pairs of x (T, heads, rope) as ggml's rope with YaRN (ext_factor 1) does."""
    n = x.shape[-1]
    i = np.arange(n // 2, dtype=np.float64)
    extrap = c.theta ** (-2 * i / n)
    magnitude = 1.0
    freqs = extrap
    if c.yarn_factor:
        def corr(n_rot):
            return n * math.log(c.yarn_orig / (n_rot * 2 * math.pi)) / (2 * math.log(c.theta))

        low, high = max(0.0, math.floor(corr(c.beta_fast))), min(n - 1.0, math.ceil(corr(c.beta_slow)))
        y = (i - low) / max(0.001, high - low)
        mix = 1 - np.minimum(1, np.maximum(0, y))
        freqs = extrap / c.yarn_factor * (1 - mix) + extrap * mix
        # llama.cpp: the context's attn_factor cancels YaRN's magnitude term when there is a log multiplier
        magnitude = 1.0 if c.yarn_log_mul else 1.0 + 0.1 * math.log(c.yarn_factor)
    ang = positions[:, None].astype(np.float64) * freqs[None, :]
    cos = (np.cos(ang) * magnitude).astype(np.float32)[:, None, :]
    sin = (np.sin(ang) * magnitude).astype(np.float32)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def attention(c: NpDeepSeek2, w: dict[str, np.ndarray], i: int, x: np.ndarray) -> np.ndarray:
    p = f"blk.{i}."
    T = x.shape[0]
    pos = np.arange(T)
    if c.q_lora:
        q = rms_norm(x @ w[p + "attn_q_a.weight"].T, w[p + "attn_q_a_norm.weight"], c.eps) @ w[p + "attn_q_b.weight"].T
    else:
        q = x @ w[p + "attn_q.weight"].T
    q = q.reshape(T, c.n_heads, c.nope + c.rope)
    q_nope, q_pe = q[..., :c.nope], rope(q[..., c.nope:], pos, c)
    kv = x @ w[p + "attn_kv_a_mqa.weight"].T
    latent = rms_norm(kv[:, :c.kv_lora], w[p + "attn_kv_a_norm.weight"], c.eps)  # what llama.cpp caches
    k_pe = rope(kv[:, None, c.kv_lora:], pos, c)  # (T, 1, rope), shared by every head
    if p + "attn_kv_b.weight" in w:
        kv_b = w[p + "attn_kv_b.weight"].reshape(c.n_heads, c.nope + c.v_dim, c.kv_lora)
    else:  # the converter's split, undone: k_b (H, L, nope) transposed back, v_b (H, v, L)
        kv_b = np.concatenate([w[p + "attn_k_b.weight"].transpose(0, 2, 1), w[p + "attn_v_b.weight"]], axis=1)
    k_nope = np.einsum("tl,hdl->thd", latent, kv_b[:, :c.nope])  # decompressed per head
    v = np.einsum("tl,hdl->thd", latent, kv_b[:, c.nope:])
    k = np.concatenate([k_nope, np.broadcast_to(k_pe, (T, c.n_heads, c.rope))], axis=-1)
    qf = np.concatenate([q_nope, q_pe], axis=-1)
    mscale = 1.0
    if c.yarn_factor:
        attn_factor = 1.0 if c.yarn_log_mul else 1.0 + 0.1 * math.log(c.yarn_factor)
        mscale = attn_factor * (1.0 + 0.1 * c.yarn_log_mul * math.log(c.yarn_factor))
    scores = np.einsum("thd,shd->hts", qf, k) * np.float32(mscale * mscale / math.sqrt(c.nope + c.rope))
    scores = scores + np.triu(np.full((T, T), -np.inf, np.float32), 1)
    out = np.einsum("hts,shd->thd", softmax(scores), v).reshape(T, -1)
    return out @ w[p + "attn_output.weight"].T


def mlp(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    g = x @ gate.T
    return (g / (1 + np.exp(-g)) * (x @ up.T)) @ down.T


def moe(c: NpDeepSeek2, w: dict[str, np.ndarray], i: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The MoE feed-forward of x (T, dim), and the experts each row chose (T, k)."""
    p = f"blk.{i}."
    logits = x @ w[p + "ffn_gate_inp.weight"].T
    scores = 1 / (1 + np.exp(-logits)) if c.gating == "sigmoid" else softmax(logits)
    choose = scores + w.get(p + "exp_probs_b.bias", np.zeros(c.n_experts, np.float32))
    if c.groups > 1:
        per = c.n_experts // c.groups
        grouped = choose.reshape(len(x), c.groups, per)
        group_score = np.sort(grouped, axis=-1)[..., -2:].sum(-1)
        best = np.argsort(-group_score, axis=-1, kind="stable")[:, :c.groups_used]
        keep = np.zeros_like(group_score, dtype=bool)
        np.put_along_axis(keep, best, True, axis=-1)
        choose = np.where(keep[..., None], grouped, -np.inf).reshape(len(x), c.n_experts)
    sel = np.argsort(-choose, axis=-1, kind="stable")[:, :c.top_k]
    gates = np.take_along_axis(scores, sel, axis=-1)
    if c.norm_topk:
        gates = gates / gates.sum(-1, keepdims=True)
    gates = gates * c.routed_scale
    out = np.zeros_like(x)
    for t in range(len(x)):
        for j, e in enumerate(sel[t]):
            out[t] += gates[t, j] * mlp(x[t:t + 1], w[p + "ffn_gate_exps.weight"][e], w[p + "ffn_up_exps.weight"][e],
                                        w[p + "ffn_down_exps.weight"][e])[0]
    if p + "ffn_gate_shexp.weight" in w:
        out = out + mlp(x, w[p + "ffn_gate_shexp.weight"], w[p + "ffn_up_shexp.weight"], w[p + "ffn_down_shexp.weight"])
    return out, sel


def forward(c: NpDeepSeek2, w: dict[str, np.ndarray], tokens: list[int] | np.ndarray) -> np.ndarray:
    """Logits (T, vocab) of the whole sequence."""
    logits, _ = forward_with_routes(c, w, tokens)
    return logits


def forward_with_routes(c: NpDeepSeek2, w: dict[str, np.ndarray],
                        tokens: list[int] | np.ndarray) -> tuple[np.ndarray, dict[int, np.ndarray]]:
    x = w["token_embd.weight"][np.asarray(tokens)]
    routes = {}
    for i in range(c.n_blocks):
        x = x + attention(c, w, i, rms_norm(x, w[f"blk.{i}.attn_norm.weight"], c.eps))
        h = rms_norm(x, w[f"blk.{i}.ffn_norm.weight"], c.eps)
        if i < c.leading_dense:
            x = x + mlp(h, w[f"blk.{i}.ffn_gate.weight"], w[f"blk.{i}.ffn_up.weight"], w[f"blk.{i}.ffn_down.weight"])
        else:
            out, routes[i] = moe(c, w, i, h)
            x = x + out
    head = w.get("output.weight", w["token_embd.weight"])
    return rms_norm(x, w["output_norm.weight"], c.eps) @ head.T, routes
