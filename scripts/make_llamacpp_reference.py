#!/usr/bin/env python3
"""Record llama.cpp's greedy answers (and its top logits at each step) for prompts on a GGUF, as JSON.

llama.cpp is never a dependency of swarmd: run this with a Python that has `llama-cpp-python` installed
in a scratch virtualenv outside the repository (its default native build dies with SIGILL on VMs that
advertise AMX; build it with AMX off, see docs/BENCHMARKS.md "Fidelity against llama.cpp"):

    /path/to/scratch/venv/bin/python scripts/make_llamacpp_reference.py MODEL.gguf \
        --prompts tests/data/llamacpp-prompts-heldout.json --out tests/data/llamacpp-reference-smollm2-extra.json

`--prompts` is a JSON list of {"kind": "plain", "prompt": TEXT} or {"kind": "chat", "user": TEXT} (rendered
through the GGUF's chat template with the generation prompt). Per case the output holds what
tests/data/llamacpp-reference-smollm2.md describes (`prompt_ids`, `greedy_ids`, `top2_gaps`,
`greedy_pieces`, `text_until_stop`, `firm_ids`, `firm_text`) plus `top_logits`: at each step the
`--top-k` best [token id, logit] pairs. The method is the reference file's: tokenize with specials
parsed (no BOS for SmolLM2), evaluate the prompt as one batch, then one token at a time, taking the
argmax of the last position's logits; no sampler, no repeat penalty, no stop at EOS. Only numpy and
llama_cpp are imported (and jinja2, which llama-cpp-python installs, for chat prompts).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
from pathlib import Path

import numpy as np

NEAR_TIE = 0.2
STOP_PIECES = ("<|endoftext|>", "<|im_end|>")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def piece(llm, token: int) -> bytes:
    """A token's bytes; `Llama.detokenize` drops pieces longer than 32 bytes, so ask with a larger buffer."""
    import llama_cpp

    buf = ctypes.create_string_buffer(512)
    n = llama_cpp.llama_token_to_piece(llm._model.vocab, token, buf, len(buf), 0, True)
    return buf.raw[:n]


def render_chat(llm, user: str) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = llm.metadata["tokenizer.chat_template"]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=[{"role": "user", "content": user}],
                                            add_generation_prompt=True)


def last_logits(llm) -> np.ndarray:
    import llama_cpp

    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()


def greedy_case(llm, prompt: str, steps: int, top_k: int) -> dict:
    ids = llm.tokenize(prompt.encode(), add_bos=True, special=True)
    llm.reset()
    llm.eval(ids)
    greedy, gaps, tops = [], [], []
    for _ in range(steps):
        logits = last_logits(llm)
        order = np.argsort(-logits, kind="stable")[:top_k]
        greedy.append(int(order[0]))
        gaps.append(round(float(logits[order[0]] - logits[order[1]]), 4))
        tops.append([[int(t), round(float(logits[t]), 4)] for t in order])
        llm.eval([greedy[-1]])
    pieces = [piece(llm, t) for t in greedy]
    text = b""
    for p in pieces:
        if p.decode(errors="replace") in STOP_PIECES:
            break
        text += p
    firm = next((j for j, g in enumerate(gaps) if g < NEAR_TIE), len(gaps))
    return {"prompt_ids": ids, "greedy_ids": greedy, "top2_gaps": gaps,
            "greedy_pieces": [p.decode(errors="replace") for p in pieces],
            "text_until_stop": text.decode(errors="replace"), "firm_ids": greedy[:firm],
            "firm_text": b"".join(pieces[:firm]).decode(errors="replace"), "top_logits": tops}


def main() -> None:
    import llama_cpp

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    llm = llama_cpp.Llama(str(args.model), n_ctx=512, n_batch=512, n_threads=args.threads,
                          n_threads_batch=args.threads, verbose=False)
    cases = []
    for spec in json.loads(args.prompts.read_text()):
        if spec["kind"] == "chat":
            case = {"kind": "chat", "user": spec["user"], "prompt": render_chat(llm, spec["user"])}
        else:
            case = {"kind": "plain", "prompt": spec["prompt"]}
        case.update(greedy_case(llm, case["prompt"], args.steps, args.top_k))
        cases.append(case)
        print(f"{case['prompt'][-40:]!r}: firm {len(case['firm_ids'])} tokens: {case['firm_text']!r}", flush=True)
    out = {"model_sha256": sha256(args.model), "llama_cpp_python_version": llama_cpp.__version__,
           "method": "tokenize(add_bos=True, special=True); eval(prompt) as one batch; then argmax and "
                     f"eval([token]) per step; flash attention off; n_threads={args.threads}",
           "cases": cases}
    args.out.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
