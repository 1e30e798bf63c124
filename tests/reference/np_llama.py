"""An independent float32 numpy Llama, the reference the tinygrad stages are tested against (tests only).

Nothing here comes from tinygrad: weights are read and dequantised by gguf-py, and RoPE rotates
adjacent pairs (x[2i], x[2i+1]) on GGUF's own Q/K layout, as llama.cpp does, instead of permuting
the weights to tinygrad's half-split form.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class NpConfig:
    n_blocks: int
    dim: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    eps: float
    rope_theta: float
    vocab: int
    # mixture of experts (llama.cpp's keys); blocks with `ffn_gate_inp` are MoE blocks
    top_k: int = 0
    gating: str = "softmax"
    norm_topk: bool = False
    routed_scale: float = 1.0


def load_gguf(path: str | Path) -> tuple[NpConfig, dict[str, np.ndarray]]:
    """Config and float32 weights (numpy order, GGUF names) of a llama GGUF, via gguf-py."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))

    def field(key: str, default=None):
        f = reader.fields.get(key)
        if f is None:
            return default
        return f.parts[f.data[0]][0].item()

    arch = "llama"
    n_heads = field(f"{arch}.attention.head_count")
    dim = field(f"{arch}.embedding_length")
    weights = {t.name: np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(
        tuple(reversed([int(d) for d in t.shape]))) for t in reader.tensors}
    config = NpConfig(
        n_blocks=field(f"{arch}.block_count"), dim=dim, hidden=field(f"{arch}.feed_forward_length"),
        n_heads=n_heads, n_kv_heads=field(f"{arch}.attention.head_count_kv", n_heads),
        head_dim=dim // n_heads, eps=field(f"{arch}.attention.layer_norm_rms_epsilon"),
        rope_theta=field(f"{arch}.rope.freq_base", 10000.0), vocab=weights["token_embd.weight"].shape[0],
        top_k=field(f"{arch}.expert_used_count", 0), gating={1: "softmax", 2: "sigmoid"}[
            field(f"{arch}.expert_gating_func", 1)], norm_topk=bool(field(f"{arch}.expert_weights_norm", False)),
        routed_scale=field(f"{arch}.expert_weights_scale", 1.0))
    return config, weights


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_pairs(x: np.ndarray, positions: np.ndarray, theta: float, factors: np.ndarray | None) -> np.ndarray:
    """Rotate adjacent pairs of the last axis; x (T, heads, head_dim)."""
    hd = x.shape[-1]
    inv = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    if factors is not None:
        inv = inv / factors
    ang = positions[:, None].astype(np.float64) * inv[None, :]  # (T, hd/2)
    cos, sin = np.cos(ang).astype(np.float32)[:, None, :], np.sin(ang).astype(np.float32)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def moe_ffn(h: np.ndarray, w: dict[str, np.ndarray], c: NpConfig) -> np.ndarray:
    """A MoE block's feed-forward part, token by token, expert by expert (llama.cpp's semantics)."""
    logits = h @ w["ffn_gate_inp.weight"].T
    if c.gating == "sigmoid":
        scores = 1.0 / (1.0 + np.exp(-logits))
    else:
        e = np.exp(logits - logits.max(-1, keepdims=True))
        scores = e / e.sum(-1, keepdims=True)
    choose = scores + w.get("exp_probs_b.bias", 0.0)
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        chosen = np.argsort(-choose[t], kind="stable")[:c.top_k]
        gates = scores[t, chosen]
        if c.norm_topk:
            gates = gates / gates.sum()
        for e_idx, g in zip(chosen, gates * c.routed_scale, strict=True):
            act = silu(w["ffn_gate_exps.weight"][e_idx] @ h[t]) * (w["ffn_up_exps.weight"][e_idx] @ h[t])
            out[t] += g * (w["ffn_down_exps.weight"][e_idx] @ act)
    if "ffn_gate_shexp.weight" in w:
        shared = (silu(h @ w["ffn_gate_shexp.weight"].T) * (h @ w["ffn_up_shexp.weight"].T)) @ w["ffn_down_shexp.weight"].T
        if "ffn_gate_inp_shexp.weight" in w:
            shared = shared / (1.0 + np.exp(-(h @ w["ffn_gate_inp_shexp.weight"])))[:, None]
        out = out + shared
    return out


class NpLlama:
    """Whole-model forward with one KV cache; `forward(tokens, start_pos)` rewinds the cache to start_pos."""

    def __init__(self, config: NpConfig, weights: dict[str, np.ndarray], max_context: int = 512):
        self.c, self.w = config, weights
        self.head = weights.get("output.weight", weights["token_embd.weight"])
        self.factors = weights.get("rope_freqs.weight")
        shape = (config.n_blocks, max_context, config.n_kv_heads, config.head_dim)
        self.k = np.zeros(shape, np.float32)
        self.v = np.zeros(shape, np.float32)

    def hidden(self, x: np.ndarray, start_pos: int, blocks: range | None = None) -> np.ndarray:
        """Run blocks (default: all) on hidden states x (T, dim) at positions start_pos..."""
        c, T = self.c, x.shape[0]
        pos = np.arange(start_pos, start_pos + T)
        group = c.n_heads // c.n_kv_heads
        scale = 1.0 / math.sqrt(c.head_dim)  # a Python float: numpy scalars would promote to float64
        mask = np.triu(np.full((T, start_pos + T), -np.inf, np.float32), k=start_pos + 1)
        for i in blocks if blocks is not None else range(c.n_blocks):
            w = {k.split(".", 2)[2]: v for k, v in self.w.items() if k.startswith(f"blk.{i}.")}
            h = rms_norm(x, w["attn_norm.weight"], c.eps)
            q = (h @ w["attn_q.weight"].T).reshape(T, c.n_heads, c.head_dim)
            k = (h @ w["attn_k.weight"].T).reshape(T, c.n_kv_heads, c.head_dim)
            v = (h @ w["attn_v.weight"].T).reshape(T, c.n_kv_heads, c.head_dim)
            q, k = rope_pairs(q, pos, c.rope_theta, self.factors), rope_pairs(k, pos, c.rope_theta, self.factors)
            self.k[i, start_pos:start_pos + T], self.v[i, start_pos:start_pos + T] = k, v
            keys = np.repeat(self.k[i, :start_pos + T], group, axis=1)  # (S, H, hd); head h uses kv head h // group
            values = np.repeat(self.v[i, :start_pos + T], group, axis=1)
            scores = np.einsum("thd,shd->hts", q, keys) * scale + mask
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            probs = scores / scores.sum(-1, keepdims=True)
            attn = np.einsum("hts,shd->thd", probs, values).reshape(T, -1)
            x = x + attn @ w["attn_output.weight"].T
            h = rms_norm(x, w["ffn_norm.weight"], c.eps)
            if "ffn_gate_inp.weight" in w:
                x = x + moe_ffn(h, w, c)
            else:
                x = x + (silu(h @ w["ffn_gate.weight"].T) * (h @ w["ffn_up.weight"].T)) @ w["ffn_down.weight"].T
        return x

    def forward(self, tokens: list[int] | np.ndarray, start_pos: int) -> np.ndarray:
        """Logits (T, vocab) of tokens at positions start_pos..."""
        x = self.w["token_embd.weight"][np.asarray(tokens)]
        x = self.hidden(x, start_pos)
        return rms_norm(x, self.w["output_norm.weight"], self.c.eps) @ self.head.T

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        logits = self.forward(prompt, 0)[-1]
        out = [int(logits.argmax())]
        for i in range(n - 1):
            out.append(int(self.forward([out[-1]], len(prompt) + i)[-1].argmax()))
        return out
