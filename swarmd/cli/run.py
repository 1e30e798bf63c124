"""`swarmd run`: generate on this machine alone, in one process, with no network.

stdout carries only the completion, flushed as it is generated; everything else (model fetch and
load, the timing summary) goes to stderr, so `swarmd run ... > out.txt` captures just the text.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

from swarmd.errors import UserError

ORDER = 50
DEFAULT_MODEL = "smollm2-135m"

HELP = "generate a completion on this machine alone (no network): the single-process baseline"
DESCRIPTION = """\
Generate a completion on this machine alone, in one process, with no network: the baseline
every distributed figure is compared with.

The completion, and nothing else, is written to stdout as it is generated; progress and the
final timing summary (prompt tokens, prefill and decode tokens/s) go to stderr.

examples:
  swarmd run "The capital of France is"
  swarmd run --chat "Give me three reasons to learn Python." --max-tokens 100
  swarmd run --model path/to/model.gguf --temperature 0.7 --top-p 0.9 --seed 1 "Once upon a time"
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("run", help=HELP, description=DESCRIPTION,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="?", help="text to continue as it is (no chat template)")
    p.add_argument("--chat", metavar="TEXT",
                   help="send TEXT as the user's message through the model's chat template (which may add "
                        "a default system prompt), and answer it as the assistant; instead of PROMPT")
    p.add_argument("--model", "-m", default=DEFAULT_MODEL,
                   help=f"a known name ({DEFAULT_MODEL}, fetched on first use), a path to a .gguf file, "
                        f"or an Ollama model name such as llama3.2:1b (default: {DEFAULT_MODEL})")
    p.add_argument("--max-tokens", "-n", type=int, default=128, metavar="N",
                   help="stop after N generated tokens (default: 128)")
    p.add_argument("--temperature", "-t", type=float, default=0.0, metavar="T",
                   help="sampling temperature; 0 picks the most likely token every step (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling: keep the most likely tokens "
                   "whose probabilities add up to P (default: 1, all)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="keep only the K most likely tokens (default: 0, all)")
    p.add_argument("--seed", type=int, default=None,
                   help="seed for sampling; the same seed gives the same completion (default: random)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="end the completion where TEXT appears (not printed); may be repeated")
    p.add_argument("--max-context", type=int, default=2048, metavar="TOKENS",
                   help="context to allocate, prompt plus completion (default: 2048, capped at the model's)")
    p.set_defaults(func=run)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _sampling_params(args: argparse.Namespace):
    from models.sampling import SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                              max_tokens=args.max_tokens, stop=tuple(args.stop))
    except ValueError as exc:
        raise UserError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    from models.catalog.names import resolve_model
    from models.config import config_from_header
    from models.generate import check_prompt_fits, generate
    from models.gguf.header import read_header
    from models.text.chat import ChatTemplate
    from models.text.tokenizer import Tokenizer

    if (args.prompt is None) == (args.chat is None):
        raise UserError("give either a PROMPT to continue or --chat TEXT, exactly one of them")
    if args.max_context < 2:
        raise UserError("--max-context must be at least 2 tokens")
    params = _sampling_params(args)

    source = resolve_model(args.model)
    header = read_header(source.path)
    tokenizer = Tokenizer(header.kv)
    config = config_from_header(header, args.max_context)  # refuses unsupported architectures
    if args.chat is not None:
        text = ChatTemplate.for_tokenizer(tokenizer).render([{"role": "user", "content": args.chat}])
    else:
        text = args.prompt
    given = args.chat if args.chat is not None else args.prompt
    prompt_ids = tokenizer.encode(text) if given else []
    check_prompt_fits(len(prompt_ids), config.max_context)

    from models.stage import StageModel, run_experts_in_graph, run_numerics
    from models.tinygrad_ext.program_cache import keep_compiled_programs_on_disk

    keep_compiled_programs_on_disk()
    _say(f"loading {source.name} ({source.path.stat().st_size / 2**20:.0f} MiB) ...")
    started = time.perf_counter()
    model = StageModel.from_gguf(source.path, max_context=config.max_context, max_requests=1,
                                  numerics=run_numerics(config), experts_in_graph=run_experts_in_graph(config))
    _say(f"loaded in {time.perf_counter() - started:.1f} s; generating " + (
        "(graphs missing from the graph cache are captured first, and kept there)" if model.graphs.enabled
        else "(a first run also compiles kernels and captures graphs)"))

    from swarmd.inference.compute import collect_if_due

    gc.disable()  # collected between tokens on this thread, never on tinygrad's worker (see swarmd.inference.compute)
    generation = generate(model, tokenizer, prompt_ids, params)
    out = sys.stdout
    try:
        for piece in generation:
            collect_if_due()
            if piece.text:
                out.write(piece.text)
                out.flush()
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
        return 0
    s = generation.stats
    _say(("\n" if out.isatty() else "") +
         f"{s.prompt_tokens} prompt tokens, prefill {s.prefill_s:.2f} s ({s.prefill_tok_s:.1f} tok/s); "
         f"{s.completion_tokens} tokens, decode {s.decode_tok_s:.1f} tok/s; finish: {s.finish_reason}")
    return 0
