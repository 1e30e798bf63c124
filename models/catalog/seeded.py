"""Seeded models: a real architecture with seeded random weights, served by name like any other model.

`random/llama-3.1-8b` (seed 0) or `random/llama-3.1-8b@7` names a dense architecture of
`planner.arch.BUILTIN_ARCHS` whose weights come from `models.catalog.synthetic.random_weights`;
`random/kimi-k2:12` (or `random/deepseek-v3:4@7`) names that many full-width blocks of a DeepSeek-V3-family
release (`models.deepseek2.RELEASES`), Q4_0 weights drawn on the device (`models.catalog.seeded_quantized`),
the first blocks dense as in the release. Every daemon draws the same weights for the blocks it holds, so a swarm serves shapes no file is at hand
for (benchmarks on GPUs, where the real GGUFs are too big to carry). The vocabulary is a byte-level
one of the architecture's size: the 256 byte tokens encode any text, the other ids decode to fixed
byte strings, and the last id is the end-of-text token.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

from models.errors import ModelError
from planner.arch import BUILTIN_ARCHS, ArchSpec

PREFIX = "random/"
ROPE_THETA = 500000.0  # Llama 3's; random weights make the choice immaterial to speed
NORM_EPS = 1e-5
MAX_CONTEXT = 131072
END_OF_TEXT = "<|endoftext|>"
CONTROL, NORMAL = 3, 1  # llama.cpp's token types


@dataclass(frozen=True)
class SeededModel:
    arch: ArchSpec  # for an MLA release, its first `blocks` blocks
    seed: int
    blocks: int | None = None  # `random/ARCH:BLOCKS`: an MLA release cut to that many blocks

    @property
    def name(self) -> str:
        blocks = f":{self.blocks}" if self.blocks is not None else ""
        return f"{PREFIX}{self.arch.name}{blocks}" + (f"@{self.seed}" if self.seed else "")

    @property
    def mla(self) -> bool:
        return self.arch.kv_lora_rank > 0

    @property
    def layout_dtype(self) -> str:
        """How the stages hold the weights: Q4_0 (int4) for MLA releases, float16 otherwise."""
        return "int4" if self.mla else "f16"

    @property
    def digest(self) -> str:
        """Equal for every daemon that draws the same weights (architecture and seed)."""
        text = json.dumps({"arch": asdict(self.arch), "seed": self.seed}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def config(self, max_context: int | None = None):  # -> tinygrad.llm.model.TransformerConfig
        from models.config import config_from_arch

        context = min(max_context or MAX_CONTEXT, MAX_CONTEXT)
        if self.mla:
            from dataclasses import replace

            from models.deepseek2 import RELEASES

            release = replace(RELEASES[self.arch.name], n_blocks=self.arch.n_blocks)
            return release.config(self.arch.vocab, context)
        return config_from_arch(self.arch, context, ROPE_THETA, NORM_EPS)

    def blocks_that_fit(self, memory: int, max_context: int, max_requests: int, *, whole: bool = True) -> int:
        """How many of the release's blocks a device with `memory` bytes holds (int4 weights, routed experts
        included, latent caches; with `whole`, the embedding and head too)."""
        from planner.arch import layout_from_arch

        layout = layout_from_arch(BUILTIN_ARCHS[self.arch.name], self.layout_dtype)  # the release's every block
        left = memory - (layout.embedding_bytes + layout.head_bytes if whole else 0) - _stacking_bytes(layout.blocks)
        for n, block in enumerate(layout.blocks):
            left -= block.total_bytes + block.kv_bytes_per_token * max_context * max_requests
            if left < 0:
                return n
        return len(layout.blocks)

    def check_fits(self, start: int, end: int, memory: int, max_context: int, max_requests: int) -> None:
        """A one-line ModelError when blocks [start, end) (and the embedding / head at the ends) do not fit
        in `memory` bytes, saying how many blocks do."""
        from planner.arch import layout_from_arch

        layout = layout_from_arch(self.arch, self.layout_dtype)
        need = sum(b.total_bytes + b.kv_bytes_per_token * max_context * max_requests for b in layout.blocks[start:end])
        need += (layout.embedding_bytes if start == 0 else 0) + (layout.head_bytes if end == len(layout.blocks) else 0)
        need += _stacking_bytes(layout.blocks[start:end])
        if need > memory:
            fit = self.blocks_that_fit(memory, max_context, max_requests, whole=start == 0 and end == len(layout.blocks))
            raise ModelError(f"{self.name}: blocks {start}-{end - 1} need {need / 1e9:.1f} GB and the device has "
                             f"{memory / 1e9:.1f} GB free: at most {fit} full-width blocks fit (random/"
                             f"{self.arch.name}:{fit})")

    def tokenizer_kv(self) -> dict[str, Any]:
        return byte_level_tokenizer_kv(self.arch.vocab)


def byte_level_tokenizer_kv(vocab: int) -> dict[str, Any]:
    """GGUF tokenizer metadata for `models.text.tokenizer.Tokenizer`: byte tokens, then filler, then end of text."""
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2",
            "tokenizer.ggml.tokens": byte_level_vocab(vocab),
            "tokenizer.ggml.token_type": [NORMAL] * (vocab - 1) + [CONTROL],
            "tokenizer.ggml.merges": [], "tokenizer.ggml.eos_token_id": vocab - 1,
            "tokenizer.ggml.add_bos_token": False}


def write_byte_level_tokenizer(writer: Any, vocab: int) -> None:
    """Put `byte_level_tokenizer_kv(vocab)` into a `gguf.GGUFWriter` (a seeded model's tokenizer in a file)."""
    kv = byte_level_tokenizer_kv(vocab)
    writer.add_tokenizer_model(kv["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(kv["tokenizer.ggml.pre"])
    writer.add_token_list(kv["tokenizer.ggml.tokens"])
    writer.add_token_types(kv["tokenizer.ggml.token_type"])
    writer.add_eos_token_id(kv["tokenizer.ggml.eos_token_id"])
    writer.add_add_bos_token(kv["tokenizer.ggml.add_bos_token"])


def byte_level_vocab(size: int) -> list[str]:
    """`size` distinct byte-level tokens: the 256 single bytes, then pairs and triples of them, then END_OF_TEXT."""
    from models.text.tokenizer import byte_decoder

    by_byte = {b: c for c, b in byte_decoder().items()}
    if size < 257:
        raise ModelError(f"a byte-level vocabulary needs at least 257 tokens, not {size}")
    tokens = [by_byte[b] for b in range(256)]
    n = 0
    while len(tokens) < size - 1:
        digits = n.to_bytes(2, "big") if n < 65536 else (n - 65536).to_bytes(3, "big")
        tokens.append("".join(by_byte[b] for b in digits))
        n += 1
    return [*tokens, END_OF_TEXT]


def parse_seeded_name(spec: str) -> SeededModel | None:
    """The seeded model `spec` names, None if it names none; ModelError for a bad one."""
    from dataclasses import replace

    from models.deepseek2 import RELEASES

    if not spec.startswith(PREFIX):
        return None
    name, _, seed_text = spec[len(PREFIX):].partition("@")
    arch_name, colon, blocks_text = name.partition(":")
    arch = BUILTIN_ARCHS.get(arch_name)
    dense = sorted(name for name, a in BUILTIN_ARCHS.items() if not a.is_moe and not a.kv_lora_rank)
    if arch_name in RELEASES:
        if not colon or not blocks_text.isdigit() or not 1 <= int(blocks_text) <= arch.n_blocks:
            raise ModelError(f"{spec!r}: say how many of {arch_name}'s {arch.n_blocks} blocks to draw, e.g. "
                             f"{PREFIX}{arch_name}:12 (blocks from 1 to {arch.n_blocks})")
        arch = replace(arch, n_blocks=int(blocks_text))
    elif arch is None or arch.is_moe or arch.kv_lora_rank or colon:
        raise ModelError(f"no seeded model {spec!r}: use {PREFIX}ARCH[@SEED] with ARCH one of {', '.join(dense)}, "
                         f"or {PREFIX}ARCH:BLOCKS[@SEED] with ARCH one of {', '.join(sorted(RELEASES))}")
    try:
        seed = int(seed_text) if seed_text else 0
    except ValueError:
        raise ModelError(f"bad seed in {spec!r}: write {PREFIX}{name}@N with an integer N") from None
    return SeededModel(arch, seed, int(blocks_text) if arch_name in RELEASES else None)


def _stacking_bytes(blocks) -> int:
    """What a stage holds twice for a moment while it loads: one MoE block's gate and up matrices of every expert,
    stacked into one (`models.expert_shard`) before the separate ones are let go."""
    return max((2 * b.moe.n_experts * b.moe.bytes_per_expert // 3 for b in blocks if b.moe is not None), default=0)
