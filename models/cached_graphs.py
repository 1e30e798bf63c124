"""Where a stage's or an expert shard's jitted graphs come from: the graph cache when it holds them, else
captured on their first call and stored there (`models.tinygrad_ext.graph_cache`).

A graph is stored under a key made of everything it depends on: the model (the GGUF's sha256, or the seed),
the owner's shape (config, block range or experts held, numerics, weight dtype, context, KV slots, prefill
chunk, attention tile, segments), the graph (prefill with or without every position's logits, decode batch
size, expert rows), the code that builds graphs (a hash of this package's sources), swarmd's kernel choices
(`SWARMD_TENSOR_CORES`, `SWARMD_TENSOR_CORE_MIN_ROWS`, `SWARMD_TENSOR_CORE_SPLIT`, `SWARMD_HALF_PREFILL_ATTENTION`,
`SWARMD_GEMM`, `SWARMD_GEMM_MIN_ROWS`, `SWARMD_GEMM_TILING`, `SWARMD_BLOCK_GEMV`, `SWARMD_BLOCK_GEMV_LAYOUT`,
`SWARMD_LATENT_ATTENTION_KERNEL`, `SWARMD_TOP_K_KERNEL`, `SWARMD_RMS_NORM_KERNEL`, the
hashes of the `SWARMD_MATVEC_OPTS`, `SWARMD_ATTENTION_OPTS` and `SWARMD_TENSOR_CORE_OPTS` tables), tinygrad and the
machine (`graph_cache.environment`), and the signature of the buffers it binds to. The buffers bound are every
tensor the owner holds (weights under their GGUF names, fused projections, GGML blocks, KV cache, RoPE table), found
by walking its attributes; a graph that reads anything else is not stored.

`warm_from_cache(stage)` runs a stage's warm-up only when the cache holds every graph it needs (a load
then costs a replay per graph, not a capture); `fill_cache(stage)` captures and stores what it lacks.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import re
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tinygrad import TinyJit
from tinygrad.engine.jit import JitError

from models.kernels.attention import half_products_on
from models.kernels.block_gemv import block_gemv_on, glu_in_kernel_on, heads_in_place_on, shared_in_experts_on
from models.kernels.cpu_attention import cpu_attention_on
from models.kernels.cpu_gemv import cpu_gemv_on
from models.kernels.float_gemv import float_gemv_on
from models.kernels.gated_sum import gated_sum_kernel_on
from models.kernels.gathered import pairs_per_kernel
from models.kernels.gemm import gemm_min_rows, gemm_on
from models.kernels.latent_attention import latent_attention_on, query_rope_on
from models.kernels.latent_rows import latent_rows_on
from models.kernels.matvec import tensor_core_min_rows, tensor_core_split, tensor_cores_on
from models.kernels.rms_norm import added_norm_on, rms_norm_kernel_on
from models.kernels.top_k import top_k_kernel_on
from models.tinygrad_ext import graph_cache
from models.tinygrad_ext.jit import Bind

if TYPE_CHECKING:
    from tinygrad import Tensor
    from tinygrad.uop.ops import UOp

log = logging.getLogger("models.cached_graphs")

# attributes of a stage or shard that hold no weights: its jits (whose outputs belong to the graphs), the
# step inputs (whose buffers are replaced as shapes come), and this object
NOT_HELD = frozenset({"_decode_jits", "_prefill_jits", "_jits", "_inputs", "graphs", "_shared", "_held_blocks",
                      "_block_owned"})
MAX_DEPTH = 6
# a held tensor's path that belongs to one block: its weights, fused projections, GGML blocks, KV cache, experts
BLOCK_PATH = re.compile(r"^(?:blk|_qkv|_gate_up|kv\.layers|_blocks\.blk|expert_shard\.weights)\.(\d+)(?=\.|$)")


class NotCached(Exception):
    """Raised by `CachedGraphs.jit` inside `only_cached()` for a graph the cache does not hold."""


class CachedGraphs:
    """The jitted graphs of one owner (a stage or an expert shard). `owner_key()` says what identifies the
    owner (None: not identifiable, nothing is cached), `label` describes it for `swarmd models --cache`."""

    def __init__(self, cache: graph_cache.GraphCache | None, owner: Any, owner_key: Callable[[Any], dict | None],
                 label: dict[str, Any]) -> None:
        self.cache = cache
        self._owner = weakref.ref(owner)  # the owner holds this object: no reference cycle back to it
        self._owner_key = owner_key
        self.label = label
        self._identity_known = False
        self._identity_key: dict[str, Any] | None = None
        self._key: dict[str, Any] | None = None
        self._bindings: dict[str, UOp] | None = None
        self._only_cached = False
        self.loaded: list[str] = []  # what came from the cache, and what was stored, for logs and tests
        self.stored: list[str] = []

    @property
    def enabled(self) -> bool:
        return self.cache is not None and self._identity() is not None

    def jit(self, name: tuple, fn: Callable[..., Any], verify: Callable[[Any], bool] | None = None) -> StoringJit:
        """The jit for graph `name` computing `fn`: the stored graph bound to this owner, or a jit that
        captures on its first call and then stores what it captured. A graph that `verify` refuses once
        captured is neither stored nor shared (`StoringJit.refused`)."""
        if not self.enabled:
            if self._only_cached:
                raise NotCached(describe(name))
            return StoringJit(fn, lambda _jit: None, verify=verify)
        assert self.cache is not None
        key = self.key_of(name)
        started = time.perf_counter()
        captured = self.cache.load(key, self.bindings())
        if captured is not None:
            self.loaded.append(describe(name))
            log.debug("graph %s of %s loaded from the cache in %.3f s", describe(name), self.label.get("owner"),
                      time.perf_counter() - started)
        elif self._only_cached:
            raise NotCached(describe(name))
        return StoringJit(fn, functools.partial(self._store, name), captured, verify=verify)

    def has(self, name: tuple) -> bool:
        return self.enabled and self.cache is not None and self.cache.has(self.key_of(name))

    @contextlib.contextmanager
    def only_cached(self) -> Iterator[None]:
        """Inside, `jit` raises NotCached instead of making a jit that would capture."""
        self._only_cached = True
        try:
            yield
        finally:
            self._only_cached = False

    def key_of(self, name: tuple) -> dict[str, Any]:
        if self._key is None:
            identity = self._identity()
            assert identity is not None
            self._key = {**identity, "buffers": graph_cache.signature(self.bindings())}
        return {**self._key, "graph": list(name)}

    def bindings(self) -> dict[str, UOp]:
        if self._bindings is None:
            owner = self._owner()
            assert owner is not None, "the graphs outlived their owner"
            self._bindings = graph_cache.named_buffers(held_tensors(owner).items())
        return self._bindings

    def _identity(self) -> dict[str, Any] | None:
        if not self._identity_known:
            owner = self._owner()
            self._identity_key = None if owner is None else self._owner_key(owner)
            self._identity_known = True
        return self._identity_key

    def _store(self, name: tuple, jit: TinyJit) -> None:
        if self.cache is None or jit.captured is None:
            return
        if self.cache.store(self.key_of(name), jit.captured, self.bindings(), {**self.label, "graph": describe(name)}):
            self.stored.append(describe(name))


class StoringJit(TinyJit):
    """A TinyJit that replays a stored graph, or captures on its first call (as `capturing_jit`) and hands
    itself to `on_capture` (unless `verify` refuses the captured graph: then `refused` is set). A stored graph
    that refuses its first inputs (tinygrad's JitError: it was made for other shapes) is captured again
    instead, and stored over the entry."""

    def __init__(self, fn: Callable[..., Any], on_capture: Callable[[TinyJit], None], captured: Any = None,
                 verify: Callable[[Any], bool] | None = None) -> None:
        super().__init__(fn)
        self.on_capture, self.verify = on_capture, verify
        self.refused = False
        self.checked: dict[Any, list[UOp]] = {}  # see replay()
        self.untried = captured is not None
        if captured is not None:
            self.captured, self.cnt = captured, 2  # replays from the first call
        else:
            self.cnt = 1  # captures on the first call (models.tinygrad_ext.jit.capturing_jit says why)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.untried:
            self.untried = False
            try:
                return super().__call__(*args, **kwargs)
            except JitError as e:
                log.warning("a stored graph does not fit its inputs (%s): capturing it again", e)
                self.reset()
                self.cnt = 1
        if self.cnt != 1:
            return super().__call__(*args, **kwargs)
        with graph_cache.capturing_without_estimates():
            ret = super().__call__(*args, **kwargs)
        if self.captured is not None:
            if self.verify is not None and not self.verify(self.captured):
                self.refused = True
            else:
                self.on_capture(self)
        return ret

    def replay(self, key: Any, inputs: Sequence[Tensor | Bind]) -> Any:
        """The graph on `inputs` (tensors and variables' values, in the function's order). The first call under
        `key` goes through TinyJit, which checks every input (tens of microseconds each); later ones replay on the
        buffers it checked then, with the variables' new values. Under one key the tensors must stay the same
        buffers in the same views."""
        from tinygrad import Tensor

        bufs = self.checked.get(key)
        if bufs is None or self.captured is None:
            ret = self(*(u.uop() if isinstance(u, Bind) else u for u in inputs))
            if self.captured is not None and not self.refused:
                self.checked[key] = [t.uop.base for t in inputs if isinstance(t, Tensor)]
            return ret
        return self.captured(bufs, {u.name: u.value for u in inputs if isinstance(u, Bind)})


def held_tensors(owner: Any) -> dict[str, Tensor]:
    """Every tensor `owner` holds, by attribute path (`blk.3.attn_q.weight`, `kv.layers.3`, `_qkv.3`): in its
    attributes, dicts, lists and tuples, and the objects of this package and of tinygrad's nn and llm
    modules it holds (blocks, layers, GGML blocks, the KV pool); not what NOT_HELD names."""
    from tinygrad import Tensor

    out: dict[str, Tensor] = {}

    def walk(path: str, value: Any, depth: int) -> None:
        if depth > MAX_DEPTH:
            return
        if isinstance(value, Tensor):
            out[path] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{path}.{k}", v, depth + 1)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{path}.{i}", v, depth + 1)
        elif hasattr(value, "__dict__") and type(value).__module__.startswith(("models.", "tinygrad.nn", "tinygrad.llm")):
            for k, v in vars(value).items():
                walk(f"{path}.{k}", v, depth + 1)

    for k, v in vars(owner).items():
        if k not in NOT_HELD:
            walk(k, v, 0)
    return out


def block_of(path: str) -> int | None:
    """The block a held tensor's path belongs to (`blk.3.attn_q.weight`, `_qkv.3`, `kv.layers.3`, ...); None for
    the owner's own (embedding, head, RoPE table)."""
    m = BLOCK_PATH.match(path)
    return int(m.group(1)) if m else None


def block_buffers(owner: Any, *, experts: bool = False) -> dict[int, tuple[list[str], list[UOp]]]:
    """Per block, the device buffers of `owner`'s tensors of that block (the routed experts its shard holds only
    with `experts`), named with the block's number left out (`blk.N.attn_q.weight#0`) and in the order of those
    names: the same for blocks alike."""
    parts: dict[int, list[tuple[str, Tensor]]] = {}
    for path, t in held_tensors(owner).items():
        m = BLOCK_PATH.match(path)
        if m and (experts or not path.startswith("expert_shard.")):
            parts.setdefault(int(m.group(1)), []).append((path[:m.start(1)] + "N" + path[m.end(1):], t))
    out = {}
    for block, ts in parts.items():
        named = sorted((n, u) for n, u in graph_cache.named_buffers(ts).items() if u.is_realized)
        out[block] = ([n for n, _ in named], [u for _, u in named])
    return out


def block_owned(owner: Any) -> set[UOp]:
    """Every buffer behind a tensor of one of `owner`'s blocks: weights, KV cache, the experts of its shard."""
    from tinygrad.uop.ops import Ops

    return {u for path, t in held_tensors(owner).items() if block_of(path) is not None
            for u in t.uop.toposort() if u.op is Ops.BUFFER}


def reads_no_block_buffer(owner: Any, captured: Any) -> bool:
    """Whether a captured graph reaches the buffers of `owner`'s blocks only through its inputs: it holds none
    of them itself (weights, KV cache), so it computes any block whose buffers it is given."""
    from tinygrad.uop.ops import Ops

    blocks = block_owned(owner)
    return not any(u.op is Ops.BUFFER and u in blocks for u in captured.linear.toposort())


def describe(name: tuple) -> str:
    """A graph's name as people read it: "prefill (blocks 0-29)", "prefill, every position's logits (...)",
    "decode, batch 4 (...)", "experts, 4 slots of 2 rows"; a segment that ends at a MoE router says so."""
    kind, *rest = name
    if kind == "experts":
        slots, rows = rest[:2]
        return f"experts, {slots} slots of {rows} rows"
    if kind not in ("prefill", "decode"):
        return " ".join(map(str, name))
    if kind == "prefill":
        text = "prefill, every position's logits" if rest[0] else "prefill"
    else:
        text = f"decode, batch {rest[0]}"
    if rest[1][0] == "block":
        return f"{text} (one block to its router, for each block alike)"
    first, end, cut = rest[1]
    blocks = f"blocks {first}-{end - 1}" if end > first else "the head alone"
    return f"{text} ({blocks}{', to the router' if cut else ''})"


@functools.cache
def code_fingerprint() -> str:
    """A hash of this package's sources: the code that builds the graphs."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def model_identity(source: str) -> str | None:
    """What identifies the weights a `source` string names: "gguf PATH DTYPE" by the file's sha256 (kept
    beside the file once computed), "seed N DTYPE" by itself; None when it names none."""
    if source.startswith("gguf "):
        from models.catalog.names import file_digest

        path, dtype = source[len("gguf "):].rsplit(" ", 1)
        try:
            return f"gguf {file_digest(Path(path))} {dtype}"
        except OSError:
            return None
    return source if source.startswith("seed ") else None


def model_label(source: str) -> str:
    """The weights a `source` string names, for people: the GGUF's file name, or the seed."""
    if source.startswith("gguf "):
        return Path(source[len("gguf "):].rsplit(" ", 1)[0]).name
    return source


def _common(owner: Any, source: str) -> dict[str, Any] | None:
    model = model_identity(source)
    if model is None:
        return None
    return {"model": model, "config": repr(owner.config), "code": code_fingerprint(),
            "matvec_opts": _options_file("SWARMD_MATVEC_OPTS"), "attention_opts": _options_file("SWARMD_ATTENTION_OPTS"),
            "tensor_core_opts": _options_file("SWARMD_TENSOR_CORE_OPTS"),
            "tensor_cores": tensor_cores_on(), "tensor_core_min_rows": tensor_core_min_rows(),
            "tensor_core_split": tensor_core_split(), "half_prefill_attention": half_products_on(),
            "gemm": gemm_on(), "gemm_min_rows": gemm_min_rows(), "gemm_tiling": os.environ.get("SWARMD_GEMM_TILING"),
            "block_gemv": block_gemv_on(), "block_gemv_layout": os.environ.get("SWARMD_BLOCK_GEMV_LAYOUT"),
            "latent_attention_kernel": latent_attention_on(), "top_k_kernel": top_k_kernel_on(),
            "rms_norm_kernel": rms_norm_kernel_on(), "gated_sum_kernel": gated_sum_kernel_on(),
            "glu_in_kernel": glu_in_kernel_on(), "heads_in_place": heads_in_place_on(), "query_rope": query_rope_on(),
            "shared_in_experts": shared_in_experts_on(),
            "latent_rows": latent_rows_on(), "float_gemv": float_gemv_on(), "added_norm": added_norm_on(),
            "cpu_gemv": cpu_gemv_on(), "cpu_attention": cpu_attention_on(), **graph_cache.environment(owner.device)}


def _options_file(variable: str) -> str | None:
    """A hash of the kernel options file the environment variable names, if any (`SWARMD_MATVEC_OPTS`:
    `models.kernels.matvec`; `SWARMD_ATTENTION_OPTS`: `models.kernels.attention`; `SWARMD_TENSOR_CORE_OPTS`:
    `models.kernels.matvec`)."""
    path = os.environ.get(variable)
    if not path:
        return None
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return f"unreadable {path}"


def _stage_key(stage: Any) -> dict[str, Any] | None:
    common = _common(stage, stage.source)
    if common is None:
        return None
    return {**common, "owner": "stage", "blocks": [stage.start, stage.end], "numerics": stage.numerics,
            "weights": stage.weight_dtype, "local_experts": stage.local_experts, "max_context": stage.max_context,
            "max_requests": stage.max_requests, "prefill_chunk": stage.prefill_chunk,
            "attention_tile": stage.attention_tile, "segments": [list(s) for s in stage.segments],
            "in_graph_pairs": pairs_per_kernel(stage.device) if stage.experts_in_graph else None}


def _experts_key(shard: Any) -> dict[str, Any] | None:
    common = _common(shard, getattr(shard, "source", ""))
    if common is None:
        return None
    return {**common, "owner": "experts", "numerics": getattr(shard, "numerics", "float"), "experts": {str(k): list(v) for k, v in sorted(shard.experts.items())}}


def for_stage(stage: Any) -> CachedGraphs:
    """The graphs of a `models.stage.StageModel` (in the default cache)."""
    label = {"model": model_label(stage.source), "owner": f"blocks {stage.start}-{stage.end - 1}",
             "device": stage.device}
    return CachedGraphs(graph_cache.default_cache(), stage, _stage_key, label)


def for_experts(shard: Any) -> CachedGraphs:
    """The graphs of a `models.expert_shard.ExpertShard` (in the default cache)."""
    label = {"model": model_label(getattr(shard, "source", "")), "device": shard.device,
             "owner": "experts of blocks " + ", ".join(str(b) for b in sorted(shard.experts))}
    return CachedGraphs(graph_cache.default_cache(), shard, _experts_key, label)


def warm_from_cache(stage: Any, **warmup: Any) -> bool:
    """`stage.warmup(**warmup)` (by default what a first request needs: prefill and one request's decode)
    when the graph cache holds every graph it runs, so that each is loaded and replayed once; False, having
    captured nothing, when it lacks any (or the stage has requests, or no cache)."""
    graphs = getattr(stage, "graphs", None)
    if not isinstance(graphs, CachedGraphs) or not graphs.enabled or len(stage.slots):
        return False
    try:
        with graphs.only_cached():
            stage.warmup(**({"most_requests": 1, "prompt_scores": False} | warmup))
    except NotCached as e:
        log.debug("not warmed from the graph cache: it lacks %s", e)
        return False
    return True


def fill_cache(stage: Any) -> bool:
    """Capture and store the graphs a first request needs that the cache lacks (the warm-up's; the others
    are stored when first captured); nothing when the stage has requests, whose steps capture what they use."""
    graphs = getattr(stage, "graphs", None)
    if not isinstance(graphs, CachedGraphs) or not graphs.enabled or len(stage.slots):
        return False
    stage.warmup(most_requests=1, prompt_scores=False)
    return True
