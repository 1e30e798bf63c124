"""Mixture-of-experts blocks on tinygrad.llm's MoE weights: Mixtral's routing, and DeepSeek-V3 / Kimi-K2's
(sigmoid scores, a selection bias, expert groups, shared experts).

A MoE block is a Llama block whose feed-forward part is a router plus routed experts (and optionally
shared experts that every token goes through). tinygrad.llm's `TransformerBlock` already holds such
weights under their GGUF names (`ffn_gate_inp`, `ffn_{gate,up,down}_exps`, `exp_probs_b`,
`ffn_*_shexp`) and its `ExpertWeights` computes the selected experts; what is added here:

* `MoEConfig`: tinygrad.llm's `TransformerConfig` plus the router's scoring function (softmax or
  sigmoid, independent of the selection bias, which tinygrad.llm ties together);
* `route`: scores, optional selection bias (it changes which experts are chosen, not their gates),
  group-limited top-k, normalised gates, routed scaling;
* `ExpertCall`: what a stage whose experts live elsewhere asks for, per MoE layer and step, and
  `gated_sum`: a row's answer from its selections' outputs, added in the order of its selections.

The experts one node holds apart from a stage are `models.expert_shard.ExpertShard`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
from tinygrad.llm.model import TransformerConfig

from models.errors import ModelError

if TYPE_CHECKING:
    from tinygrad import Tensor

GATING = ("softmax", "sigmoid")
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
ROUTED_WEIGHTS = tuple(f"{t}.weight" for t in EXPERT_TENSORS)  # GGUF name suffixes of the routed experts


@dataclass(frozen=True)
class MoEConfig(TransformerConfig):
    """A TransformerConfig whose router scores with `expert_gating` (softmax or sigmoid), and picks its top
    k among the experts of its best `expert_groups_used` groups when `expert_groups` > 1 (DeepSeek-V3)."""

    expert_gating: str = "softmax"
    expert_groups: int = 0
    expert_groups_used: int = 0


def is_moe(config: TransformerConfig) -> bool:
    return config.num_experts > 0


def is_moe_block(config: TransformerConfig, i: int) -> bool:
    return config.num_experts > 0 and i >= config.leading_dense_blocks


def block_config(config: TransformerConfig, i: int) -> TransformerConfig:
    """The config block i is built from: leading dense blocks of a MoE model get a dense FFN of
    `dense_hidden_dim` (as tinygrad.llm's Transformer does)."""
    if not config.num_experts or is_moe_block(config, i):
        return config
    return replace(config, num_experts=0, num_experts_per_tok=0, shared_expert_dim=0,
                   hidden_dim=config.dense_hidden_dim or config.hidden_dim)


def gating_of(config: TransformerConfig) -> str:
    gating = getattr(config, "expert_gating", None) or ("sigmoid" if config.expert_bias else "softmax")
    if gating not in GATING:
        raise ModelError(f"unknown expert gating {gating!r}: use one of {', '.join(GATING)}")
    return gating


def route(blk, x: Tensor, config: TransformerConfig, logits: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Gates (..., k) float32 and selected experts (..., k) int32 of x (B, T, dim).

    Scores are softmax or sigmoid of the router logits; a selection bias (DeepSeek-V3's
    `exp_probs_b`) is added only to choose the top k (within the best groups, when the config has
    groups); the chosen scores are normalised to sum to 1
    when `norm_topk_prob`, then multiplied by `routed_scaling_factor`. `logits`: the router's, when the
    caller computed them. On NVIDIA GPUs a sigmoid router without groups is one kernel (`routed_top_k`)."""
    from models.kernels.top_k import routed_top_k, top_k_kernel_fits

    logits = (x.float() @ blk.ffn_gate_inp.weight.float().T if logits is None else logits).float()
    k, bias = config.num_experts_per_tok, blk.exp_probs_b["bias"] if hasattr(blk, "exp_probs_b") else None
    if gating_of(config) == "sigmoid" and getattr(config, "expert_groups", 0) <= 1 and top_k_kernel_fits(logits, k):
        return routed_top_k(logits, bias, k, normalise=config.norm_topk_prob, scale=config.routed_scaling_factor)
    scores = logits.sigmoid() if gating_of(config) == "sigmoid" else logits.softmax(-1)
    choose = scores + bias.float() if bias is not None else scores
    if getattr(config, "expert_groups", 0) > 1:
        choose = _best_groups(choose, config.expert_groups, config.expert_groups_used)
    sel = top_k(choose, k)
    gates = scores.gather(-1, sel)
    if config.norm_topk_prob:
        gates = gates / gates.sum(axis=-1, keepdim=True)
    return gates * config.routed_scaling_factor, sel


def top_k(x: Tensor, k: int) -> Tensor:
    """The indices (int32) of the k largest of x along its last axis, the largest last; of equal values the one of
    lower index ranks higher. The same selection as `tinygrad.llm.model.pairwise_topk`, whose kernel makes each
    selected index count every element's rank itself (a few threads looping over n * n comparisons); here every
    element's rank is a kernel of its own first, and on NVIDIA GPUs a warp a row picks them (`models.kernels.top_k`)."""
    from tinygrad import Tensor, dtypes

    from models.kernels.top_k import top_k_kernel, top_k_kernel_fits

    if top_k_kernel_fits(x, k):
        return top_k_kernel(x, k)
    n = x.shape[-1]
    at = Tensor.arange(n, device=x.device)
    beats = (x.unsqueeze(-1) > x.unsqueeze(-2)) | ((x.unsqueeze(-1) == x.unsqueeze(-2)) & (at.reshape(n, 1) < at.reshape(1, n)))
    rank = beats.sum(axis=-1, dtype=dtypes.int32).contiguous()  # (..., n): a permutation of 0 .. n-1
    wanted = Tensor.arange(n - k, n, device=x.device, dtype=dtypes.int32)  # (k,)
    return (rank.unsqueeze(-2) == wanted.unsqueeze(-1)).where(at.cast(dtypes.int32), 0).sum(-1, dtype=dtypes.int32)


def _best_groups(choose: Tensor, groups: int, used: int) -> Tensor:
    """`choose` (B, T, E) with the experts outside each row's `used` best groups set to -inf; a group's score
    is the sum of its two highest choice scores (DeepSeek-V3's and llama.cpp's group-limited routing)."""
    from tinygrad import Tensor

    b, t, n = choose.shape
    per = n // groups
    scores = choose.reshape(b, t * groups, per)
    top2 = scores.gather(-1, top_k(scores, 2))
    best = top_k(top2.sum(-1).reshape(b, t, groups), used)  # (B, T, used)
    keep = (best.unsqueeze(-1) == Tensor.arange(groups, device=choose.device)).sum(-2) > 0  # (B, T, groups)
    return keep.unsqueeze(-1).where(choose.reshape(b, t, groups, per), -math.inf).reshape(b, t, n)


def routed_experts(blk, x: Tensor, gates: Tensor, sel: Tensor) -> Tensor:
    """Sum over the k selected experts of gate * expert(x), with every expert of the block held here
    (tinygrad.llm's `ExpertWeights`): x (B, T, dim) -> (B, T, dim)."""
    h = x.unsqueeze(2)
    act = (blk.ffn_gate_exps(sel, h).silu() * blk.ffn_up_exps(sel, h)).contiguous()
    return (blk.ffn_down_exps(sel, act) * gates.unsqueeze(-1)).sum(axis=2)


def shared_experts(blk, x: Tensor) -> Tensor | None:
    """The shared experts' output (gated by a sigmoid when the block has `ffn_gate_inp_shexp`), or None."""
    if not hasattr(blk, "ffn_gate_shexp"):
        return None
    out = blk.ffn_down_shexp(blk.ffn_gate_shexp(x).silu().contiguous() * blk.ffn_up_shexp(x))
    if hasattr(blk, "ffn_gate_inp_shexp"):
        out = out * (x * blk.ffn_gate_inp_shexp["weight"]).sum(axis=-1, keepdim=True).sigmoid()
    return out


@dataclass(frozen=True)
class ExpertCall:
    """One MoE layer's routed work for one step: rows (N, dim) float32 (the FFN-normed hidden states),
    their selected experts sel (N, k) int32 (-1: not asked here) and gates (N, k) float32. The answer
    is (N, dim) float32: per row, the sum over its selected experts of gate * expert(row)."""

    layer: int
    rows: np.ndarray
    sel: np.ndarray
    gates: np.ndarray

    def only(self, experts: set[int] | frozenset[int]) -> ExpertCall | None:
        """The part of this call for `experts` (rows that select none of them are dropped; their
        other selections become -1), or None when no row selects any; `row_index` says which rows."""
        mask = np.isin(self.sel, list(experts))
        keep = mask.any(axis=1)
        if not keep.any():
            return None
        return ExpertCall(self.layer, self.rows[keep], np.where(mask, self.sel, -1)[keep].astype(np.int32),
                          np.where(mask, self.gates, 0.0)[keep].astype(np.float32))


ExpertFn = Callable[[ExpertCall], np.ndarray]


def rows_for(call: ExpertCall, experts: set[int] | frozenset[int]) -> np.ndarray:
    """Indices of the rows of `call` that select any of `experts` (the rows `call.only` keeps)."""
    return np.flatnonzero(np.isin(call.sel, list(experts)).any(axis=1))


def gated_sum(call: ExpertCall, outputs: np.ndarray) -> np.ndarray:
    """(rows, dim): per row, gate times output of each selection, added in the order of the row's selections
    (k = 0, 1, ...), whoever computed them; `outputs` (pairs, dim) in row-major order of `call.sel >= 0`."""
    n, k = call.sel.shape
    chosen = call.sel >= 0
    per = np.zeros((n, k, call.rows.shape[1]), np.float32)
    per[chosen] = outputs
    out = np.zeros((n, call.rows.shape[1]), np.float32)
    for j in range(k):
        out += call.gates[:, j:j + 1].astype(np.float32) * per[:, j]
    return out
