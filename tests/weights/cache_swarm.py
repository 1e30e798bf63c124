"""Real `swarmd join` processes for the weights tests, each with a model cache of its own.

Every daemon gets `XDG_CACHE_HOME=<its home>/cache` and no `SWARMD_MODELS`, as separate machines would have;
the kernel cache (`CACHEDB`) stays shared, so that no daemon compiles what another already did. A daemon that
"holds" the model finds its GGUF in its cache (a symbolic link to the test's copy); the others start with an
empty cache. What each fetched is read back from its log and its cache folder. The daemons keep the default
timings, as the other multi-daemon tests do: with a stage compiling its graphs in each of six processes on two
cores, the local-test preset's half-second probes declare busy members dead.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx

from models.gguf.header import GGUFHeader, read_header
from models.gguf.loader import ROUTED_TENSORS, tensor_nbytes
from tests.swarm.daemons import Daemon, http, stop_all, wait_until


def cachedb() -> str:
    from tinygrad import helpers

    return str(helpers.CACHEDB)


class CacheSwarm:
    def __init__(self, base: Path, bench_file: Path, model: str, *, extra: tuple[str, ...] = ()) -> None:
        self.base, self.bench_file, self.model, self.extra = base, bench_file, model, extra
        self.daemons: dict[str, Daemon] = {}

    def daemon(self, name: str, *, holding: Path | None = None, in_cache: str = "", model: str | None = None,
               env: dict[str, str | None] | None = None, extra: tuple[str, ...] = ()) -> Daemon:
        """A daemon `name`; with `holding`, that GGUF is in its cache at `in_cache` (a path under
        swarmd/models)."""
        home = self.base / name
        cache = home / "cache"
        if holding is not None:
            link = cache / "swarmd" / "models" / in_cache
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(holding)
        d = Daemon(home, None, bench_file=self.bench_file, swarm="weights",
                   extra=("--model", model or self.model, *self.extra, *extra),
                   env={"XDG_CACHE_HOME": str(cache), "SWARMD_MODELS": None, "CACHEDB": cachedb(), **(env or {})})
        self.daemons[name] = d
        return d

    def models_dir(self, name: str) -> Path:
        return self.base / name / "cache" / "swarmd" / "models"

    def disk_bytes(self, name: str) -> int:
        """Bytes the daemon's model cache takes on disk (holes of sparse files take none, links next to none)."""
        return sum(p.lstat().st_blocks * 512 for p in self.models_dir(name).rglob("*") if p.is_file() or p.is_symlink())

    def manifest_bytes(self, name: str) -> int:
        """The manifest as a partial model keeps it: the GGUF header, the hashes, the record of chunks held."""
        [folder] = [p for p in (self.models_dir(name) / "manifests").iterdir() if len(p.name) == 64]
        header = read_header(folder / "model.gguf").data_start
        return header + sum((folder / f).stat().st_size for f in ("manifest.cbor", "held", "names.json"))

    def running(self) -> list[Daemon]:
        return [d for d in self.daemons.values() if d.proc is not None and d.proc.poll() is None]

    def wait_ready_plan(self, peers: set[str], timeout: float = 300.0, *, standbys: int = 0) -> dict[str, Any]:
        """Until every running daemon agrees on a plan whose stages are exactly `peers`, with `standbys` spares,
        every part of it loaded."""
        def ready() -> dict[str, Any] | None:
            docs = [d.status() for d in self.running()]
            plans = [doc["plan"] for doc in docs]
            if not plans[0] or any(p != plans[0] for p in plans):
                return None
            plan = plans[0]
            if {s["peer_id"] for s in plan["stages"]} != peers or len(plan["standbys"]) != standbys:
                return None
            me = {doc["self"]["peer_id"]: doc["assignment"]["state"] for doc in docs}
            wanted = {s["peer_id"]: "ready" for s in plan["stages"]} | {s["peer_id"]: "standby" for s in plan["standbys"]}
            return plan if all(me.get(p) == state for p, state in wanted.items()) else None

        return wait_until(ready, timeout, f"a loaded plan over {len(peers)} stages and {standbys} standbys")

    def stop(self) -> None:
        stop_all(list(self.daemons.values()))

    def logs(self) -> str:
        return "\n".join(f"--- {name}\n{d.log()[-3000:]}" for name, d in self.daemons.items())


CONTEXT = 256
N_TOKENS = 8
PROMPT = "The capital of France is"


def greedy(path, prompt: str = PROMPT, *, numerics: str | None = None) -> list[int]:
    """The whole model's greedy tokens in this process (`models.generate`: the loop of `swarmd run`)."""
    from models.generate import generate
    from models.sampling import SamplingParams
    from models.stage import SERVING_NUMERICS, StageModel
    from models.text.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(path)
    model = StageModel.from_gguf(path, max_context=CONTEXT, max_requests=1, numerics=numerics or SERVING_NUMERICS)
    gen = generate(model, tok, tok.encode(prompt), SamplingParams(max_tokens=N_TOKENS))
    for _ in gen:
        pass
    return gen.token_ids


def generate(api: str, prompt: str = PROMPT) -> list[int]:
    tokens: list[int] = []
    with http.stream("POST", f"{api}/api/v0/generate", json={"prompt": prompt, "max_tokens": N_TOKENS},
                      timeout=httpx.Timeout(30.0, read=600.0)) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            event = json.loads(line)
            if event["event"] == "token":
                tokens.append(event["id"])
            elif event["event"] == "error":
                raise AssertionError(event)
    return tokens


def check_fetched_only_what_was_assigned(swarm: CacheSwarm, name: str, header) -> None:
    """The daemon's model cache holds the tensors of the assignments it was given, plus the manifest: within
    5 % of them, and at least its last assignment's."""
    d = swarm.daemons[name]
    blocks, experts = assignments(d.log_path.read_text())
    assert blocks or experts, d.log()
    expected = tensor_bytes(header, blocks, experts) + swarm.manifest_bytes(name)
    doc = d.status()["assignment"]
    last = doc["layers"] or [0, 0]
    now = tensor_bytes(header, set(range(*last)), {int(b): set(es) for b, es in doc["experts"].items()})
    held = swarm.disk_bytes(name)
    assert now + swarm.manifest_bytes(name) <= held * 1.05, (name, held, now)
    assert held <= expected * 1.05, (name, held, expected, sorted(blocks), experts)


# --- what a daemon was given, from its log --------------------------------------------------------------------
ASSIGNED = re.compile(r"weights for (?:blocks (\d+)-(\d+))?(?: and )?(?:experts ((?:x\d+:[\d,-]+ ?)+))?:")


def assignments(log: str) -> tuple[set[int], dict[int, set[int]]]:
    """Every block and expert the daemon prepared the weights of (each assignment it was given), from its log."""
    blocks: set[int] = set()
    experts: dict[int, set[int]] = {}
    for a, b, spec in ASSIGNED.findall(log):
        if a:
            blocks.update(range(int(a), int(b) + 1))
        for item in spec.split():
            block, spans = item[1:].split(":")
            for span in spans.split(","):
                lo, _, hi = span.partition("-")
                experts.setdefault(int(block), set()).update(range(int(lo), int(hi or lo) + 1))
    return blocks, experts


def tensor_bytes(header: GGUFHeader, blocks: set[int], experts: dict[int, set[int]]) -> int:
    """Bytes of the tensors a stage of `blocks` needs (the embedding with block 0, the output norm and head with the
    last block; routed experts apart in a MoE model) and of `experts`, read off the GGUF's own tensor table."""
    n_blocks = int(header.arch_key("block_count"))
    moe = any(n.endswith("_exps.weight") for n in header.tensors)
    names = {n for n in header.tensors if n.startswith("blk.") and int(n.split(".")[1]) in blocks
             and not (moe and n.endswith("_exps.weight"))}
    if 0 in blocks:
        names.add("token_embd.weight")
    if n_blocks - 1 in blocks:
        names |= {"output_norm.weight", "output.weight" if "output.weight" in header.tensors else "token_embd.weight"}
    if "rope_freqs.weight" in header.tensors and blocks:
        names.add("rope_freqs.weight")
    size = sum(tensor_nbytes(header.tensors[n]) for n in names)
    for block, es in experts.items():
        for t in ROUTED_TENSORS:
            info = header.tensors[f"blk.{block}.{t}"]
            size += tensor_nbytes(info) // info.shape[0] * len(es)
    return size
