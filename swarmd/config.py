"""A daemon's settings (`DaemonConfig`) and timings (`Timings`, with named presets), each declared once.

Each is a dataclass field with its default and its help (`setting(...)`, `timing(...)`). `swarmd join`'s options
(`swarmd.cli.join`), the keys of its TOML config file (`config_changes`), the environment variables that set a few
of them (`env_changes`) and the tables in docs/SETTINGS.md (`settings_markdown`) are all derived from the fields.
Adding a setting is adding one field. (Limits that are not the user's to set stay with their component:
`TransportConfig`, `GateLimits`, `DataPlaneConfig`.)

Timings follow memberlist's habit: one frozen object with named presets (LAN for real use,
LOCAL_TEST for fast tests on one machine) instead of literals scattered through the code.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
import types
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from functools import cache
from pathlib import Path
from typing import Any, get_type_hints
from urllib.parse import urlsplit

from swarmd.errors import UserError
from swarmd.spec_settings import SpecError, SpecSettings


@dataclass(frozen=True)
class Setting:
    """How one field is set beyond what its type says: its help, and what its option and TOML key need."""

    help: str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None  # the values the `swarmd join` option accepts
    option: str = ""  # the `swarmd join` option, when it is not --<name with dashes>
    env: str = ""  # an environment variable that sets it (over the config file, under the command line)
    parse: Callable[[Any], Any] | None = None  # a command-line string or TOML value -> the field's value
    default_text: str = ""  # the default as docs/SETTINGS.md shows it, when the value does not say it


def setting(default: Any = MISSING, help: str = "", *, default_factory: Any = MISSING, **how: Any) -> Any:
    """A `DaemonConfig` field: its default, its help (what `swarmd join --help` and docs/SETTINGS.md say), and
    `Setting`'s other keywords where the field's type is not enough to read it from text or TOML."""
    metadata = {"setting": Setting(help, **how)}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def timing(default: float, help: str) -> Any:
    """A `Timings` field (seconds): its default (the LAN preset's) and its help."""
    return field(default=default, metadata={"setting": Setting(help)})


# Members a daemon hears from at the base rates (a heartbeat each `heartbeat_interval`, a probe each
# `probe_interval`). Each message costs every daemon's event loop about the same, so a larger swarm spreads both
# out (`Timings.spread`), and what a daemon handles a second stays that of a swarm this size.
BASE_RATE_MEMBERS = 8


@dataclass(frozen=True)
class Timings:
    """Seconds, all of them."""

    heartbeat_interval: float = timing(1.0, "the membership's beat: its tick (a quarter of it), dial retries, and how "
                                            "long a member whose redials are refused must be silent to be dead")
    refresh_interval: float = timing(10.0, "a signed descriptor on the gossip topic this often when nothing in it "
                                           "changed (less often in swarms of over "
                                           f"{BASE_RATE_MEMBERS} members), and at once when the node's view, plan "
                                           "or part of it changes; liveness comes from the direct probes")
    suspect_after: float = timing(3.0, "silence (no heartbeat, no probe answer) after which a member is suspect "
                                       "(scaled by log N, and as heartbeats spread)")
    probe_timeout: float = timing(1.0, "a direct probe slower than this failed")
    probe_interval: float = timing(2.0, "routine direct probes of each member (liveness, RTT, hung peers; less often "
                                        f"in swarms of over {BASE_RATE_MEMBERS} members)")
    dead_retention: float = timing(60.0, "how long a dead member stays in status before it is forgotten")
    replan_debounce: float = timing(1.0, "membership quiet for this long before the leader re-plans")
    replan_after_loss: float = timing(0.1, "the debounce when a member holding a stage is gone (the chain is broken)")
    plan_republish_interval: float = timing(3.0, "the leader repeats its plan for late joiners")
    dial_backoff_initial: float = timing(0.5, "first retry of a failed dial (bootstrap, members); doubles, with jitter")
    dial_backoff_max: float = timing(8.0, "the longest wait between two dials of one peer")
    dial_timeout: float = timing(5.0, "a dial slower than this failed")
    leave_grace: float = timing(0.5, "after publishing a leave, time for it to spread before closing")
    # requests through the pipeline
    ready_timeout: float = timing(120.0, "a request waits this long for the plan's stages to be ready")
    first_token_timeout: float = timing(900.0, "a prefill on a cold kernel cache compiles for minutes on a small CPU")
    token_timeout: float = timing(120.0, "the longest wait for the next token once the first came")
    request_idle_timeout: float = timing(1800.0, "a stage frees a request whose head has said nothing for this long")
    send_timeout: float = timing(30.0, "an actor message not acked by then is given up (its retries included)")
    cancel_timeout: float = timing(30.0, "how long the head tries to tell a stage that a request is over: as long "
                                         "as a frame of it may still arrive")
    drain_timeout: float = timing(60.0, "a daemon leaving on purpose waits this long for the requests it heads")

    def spread(self, n_members: int) -> float:
        """How much further apart heartbeats and routine probes are in a swarm of this size than the intervals
        say: 1 up to `BASE_RATE_MEMBERS` members, in proportion to the members above."""
        return max(1.0, n_members / BASE_RATE_MEMBERS)

    def heartbeat_period(self, n_members: int) -> float:
        """How often a member publishes its heartbeat when nothing in it changed."""
        return self.refresh_interval * self.spread(n_members)

    def probe_period(self, n_members: int) -> float:
        """How often a member probes each other member."""
        return self.probe_interval * self.spread(n_members)

    def suspicion_timeout(self, n_members: int) -> float:
        """memberlist's rule: suspicion grows with log10 of the swarm size, never below the base; and as many
        heartbeats and probes may be missed as at the base, however far apart `spread` puts them."""
        return self.suspect_after * max(1.0, math.log10(max(1, n_members))) * self.spread(n_members)

    def gossip_timeout(self, n_members: int) -> float:
        """No heartbeat from a member that answers its probes for this long: its gossip stream is broken (three
        refreshes missed, and never sooner than two suspicion timeouts)."""
        return max(2 * self.suspicion_timeout(n_members), 3 * self.heartbeat_period(n_members))


LAN = Timings()
LOCAL_TEST = Timings(
    heartbeat_interval=0.5,
    refresh_interval=0.5,
    suspect_after=1.5,
    probe_timeout=0.5,
    probe_interval=1.0,
    dead_retention=30.0,
    replan_debounce=0.3,
    plan_republish_interval=1.0,
    dial_backoff_initial=0.2,
    dial_backoff_max=2.0,
    dial_timeout=3.0,
    leave_grace=0.2,
)
PRESETS: dict[str, Timings] = {"lan": LAN, "local-test": LOCAL_TEST}

DEFAULT_LISTEN = "/ip4/0.0.0.0/tcp/0"
DEFAULT_API = "127.0.0.1:8765"
DEFAULT_MODEL = "smollm2-135m"
DEFAULT_SWARM = "swarmd"
DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # a 128k-token prompt as a list of ids fits
DEFAULT_MAX_TOKENS = 4096  # the most tokens one request may ask for
PLANNED_REQUESTS = 4  # requests whose KV caches the planner budgets on every stage (at most max_requests)


def default_home() -> Path:
    return Path(os.environ.get("SWARMD_HOME") or Path.home() / ".swarmd")


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
          "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


def parse_size(text: str | int) -> int:
    """'8GiB', '512MB', '12G', 1000 -> bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise UserError(f"cannot read {text!r} as a size (examples: 8GiB, 512MB, 12G)")
    unit = (m.group(2) or "").lower().removesuffix("b")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_api_address(text: str) -> tuple[str, int]:
    """'HOST:PORT', '[::1]:PORT' or 'http://HOST:PORT' -> (host, port)."""
    raw = text if "://" in text else f"http://{text}"
    try:
        parts = urlsplit(raw)
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port = None, None
    if not host or port is None:
        raise UserError(f"--api {text!r} is not HOST:PORT (for example 127.0.0.1:8765)")
    return host, port


def parse_timings(value: Any) -> Timings:
    """A preset name, or a table with `preset` and any Timings field (dashes or underscores)."""
    if isinstance(value, str):
        return _preset(value)
    if not isinstance(value, dict):
        raise UserError("config key 'timings' must be a preset name or a table")
    table = {k.replace("-", "_"): v for k, v in value.items()}
    base = _preset(str(table.pop("preset", "lan")))
    known = {f.name for f in fields(Timings)}
    unknown = set(table) - known
    if unknown:
        raise UserError(f"unknown timings keys: {', '.join(sorted(unknown))} (known: {', '.join(sorted(known))})")
    try:
        return replace(base, **{k: float(v) for k, v in table.items()})
    except (TypeError, ValueError) as e:
        raise UserError(f"bad timings value: {e}") from e


def _preset(name: str) -> Timings:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise UserError(f"unknown timings preset {name!r} (known: {', '.join(PRESETS)})") from None


EXPERT_PLACEMENTS = ("auto", "spread", "local")
WIRE_DTYPES = ("", "float32", "float16", "bfloat16")
DATA_PLANES = ("tls", "libp2p")
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class DaemonConfig:
    """What `swarmd join` runs with: command line over environment over config file over defaults.

    Each field is one setting, declared once: `swarmd join --<name with dashes>` (unless `option` says
    otherwise), the TOML key `<name>` (dashes or underscores) and its row in docs/SETTINGS.md."""

    swarm: str = setting(DEFAULT_SWARM, "swarm name: a namespace and the gossip topic prefix (default: swarmd)")
    listen: tuple[str, ...] = setting(
        (DEFAULT_LISTEN,), "where to listen for peers, repeatable (default: /ip4/0.0.0.0/tcp/0)", metavar="MULTIADDR")
    announce: tuple[str, ...] = setting(
        (), "what peers are told to dial instead of the listen addresses, repeatable", metavar="MULTIADDR")
    bootstrap: tuple[str, ...] = setting(
        (), "a member to join through, ending in /p2p/<peer id>; repeatable (also SWARMD_BOOTSTRAP)",
        metavar="MULTIADDR", env="SWARMD_BOOTSTRAP", default_text="none: found a swarm")
    model: str = setting(
        DEFAULT_MODEL, "model to serve: a known name, a .gguf path, an Ollama name, or manifest:HASH (default: "
                       "smollm2-135m). Not on this machine: fetched from the members named by --bootstrap (only "
                       "the tensors the plan assigns), else downloaded or written here")
    api: str = setting(DEFAULT_API, "local HTTP API address (default: 127.0.0.1:8765)", metavar="HOST:PORT")
    home: Path = setting(help="state directory (default: $SWARMD_HOME or ~/.swarmd)", default_factory=default_home,
                         default_text="$SWARMD_HOME or ~/.swarmd")
    device: str = setting("auto", "tinygrad device: auto, CPU, CUDA, METAL, ... (default: auto)")
    memory_limit: int | None = setting(None, "memory this daemon may use, e.g. 12GiB", metavar="SIZE",
                                       parse=parse_size, default_text="what the device has free")
    device_label: str = setting("", "name shown for this device, e.g. 'RTX 3060 12GB'", metavar="TEXT",
                                default_text="the device's name")
    mdns: bool = setting(False, "also find peers on the LAN with mDNS")
    uplink_mbps: float | None = setting(
        None, "this daemon's upload bandwidth in Mbit/s, for the planner (default: the network interface's speed, "
              "else 1000)", metavar="MBPS", default_text="the interface's speed, else 1000")
    plan: Path | None = setting(
        None, "adopt this Plan instead of computing one: a plan file with slots (`swarmd plan --fleet ... --out FILE`) "
              "on every daemon, each with its --slot; or a Plan naming peer ids (`swarmd plan --json`) on the "
              "founding daemon only, adopted once the peers it names have joined", metavar="FILE",
        default_text="none: the leader plans")
    slot: str = setting(
        "", "with --plan FILE: the slot of the plan file this daemon takes (its stage and experts); the leader binds "
            "each slot to the first daemon claiming it and refuses a second claim", metavar="NAME",
        default_text="none")
    claim_timeout: float = setting(
        120.0, "with --plan FILE: after this long the leader's status names the slots no daemon has claimed "
               "(default 120)", metavar="SECONDS")
    standby: bool = setting(
        False, "be a spare: hold a warm copy of one stage's blocks and take that stage over at once if its daemon "
               "is lost (the planner gives this daemon no stage while the others suffice)")
    full_replay: bool = setting(
        False, "when a request this daemon heads moves to a new chain, every stage rebuilds its KV cache from the "
               "token history (by default the stages that stay keep theirs; for comparisons)")
    full_reload: bool = setting(
        False, "when the plan changes this daemon's block range, read the whole new range from the model (by "
               "default the blocks it already holds are kept and only the others read; for comparisons)")
    warmup: bool | None = setting(
        None, "capture every jitted graph of the stage (prefill, prompt scoring, decode at each batch size up to "
              "--max-requests) before it reports ready: a slower start, and no request waits for the compiler "
              "later (default: on for GPUs, where a batch size's first use costs seconds per graph; off for CPUs, "
              "where each graph costs many seconds at start)", default_text="on for GPUs, off for CPUs")
    max_requests: int = setting(
        32, "the most requests this daemon's stage holds at once (its KV cache slots): as many as its memory allows "
            "at the full context, up to N (default 32)", metavar="N")
    max_queued: int = setting(
        256, "requests this daemon accepts beyond what the swarm runs now: they wait in turn (fair across clients) "
             "for a free slot; one more is refused with HTTP 429 and Retry-After (default 256; 0: no queue)",
        metavar="N")
    max_context: int = setting(2048, "context per request, prompt plus completion (default 2048, capped at the "
                                     "model's)", metavar="TOKENS")
    wire_dtype: str = setting(
        "", "activations on the wire: float32 is lossless (the default); the others halve the bytes",
        choices=("float32", "float16", "bfloat16"), default_text="float32 (the compute dtype, lossless)")
    inline_step_ms: float = setting(
        50.0, "a decode step seen to take at most this long runs on the event loop's own thread when the compute "
              "thread is idle, which saves two thread hand-overs per step; the daemon answers nothing else "
              "meanwhile (default 50; 0: every step on the compute thread)", metavar="MS")
    speculate: str = setting(
        "off", "speculative decoding for the requests this daemon heads: off (the default), ngram (drafts from the "
               "request's own context: prompt lookup, strong on code and editing) or model:NAME (a small draft "
               "model with the served model's vocabulary, run here, e.g. model:smollm2-135m); each pass through "
               "the chain then verifies several tokens, with the same output", metavar="MODE")
    draft_tokens: int = setting(
        4, "the most tokens drafted per pass (default 4; the number adapts to the acceptance seen, and a request "
           "may ask for fewer with \"speculate\": {\"draft_tokens\": K})", metavar="K")
    hot_lane: bool | None = setting(
        None, "a token's messages (activations, sampled tokens, expert batches) travel on data-plane streams of "
              "their own, read by a thread that runs a short decode step and sends its output on without waiting "
              "for the event loop (needs the TLS data plane; --no-hot-lane: all through the actor transport, for "
              "comparisons)", default_text="on")
    expert_placement: str = setting(
        "auto", "MoE models: keep each block's experts with its stage (local), spread them over the other daemons "
                "(spread), or let the planner choose (auto, the default: spread under the balanced policy)",
        choices=EXPERT_PLACEMENTS)
    data_plane: str = setting("tls", "tensors over pinned TLS sockets (default) or over the libp2p streams themselves",
                              choices=DATA_PLANES)
    data_plane_port: int = setting(
        0, "TCP port of the TLS data plane (default: any free one); behind a NAT with forwarded ports, forward this "
           "one too (it listens on the --listen address)", metavar="PORT", default_text="any free port")
    dial_map: tuple[str, ...] = setting(
        (), "advanced, repeatable: connect to the second address whenever this daemon dials the first (libp2p and "
            "the data plane alike); `swarmd cluster up` routes traffic between regions through its link emulator "
            "this way", metavar="HOST:PORT=HOST:PORT", default_text="none")
    relay_service: bool | None = setting(
        None, "serve as a circuit relay (v2, within limits on circuits, bytes and time) for members that cannot be "
              "reached directly; only a reachable daemon is any use as one (default: on; --no-relay-service to "
              "opt out)", default_text="on")
    relays: tuple[str, ...] = setting(
        (), "a relay (ending in /p2p/<peer id>) to keep a reservation on when this daemon cannot be reached "
            "directly, besides the members that serve relaying; repeatable", metavar="MULTIADDR", option="--relay",
        default_text="none: members that serve relaying")
    hole_punching: bool | None = setting(
        None, "try hole punching (DCUtR) with members reached only through a relay (default: on; "
              "--no-hole-punching to opt out)", default_text="on")

    weights_serve_mbps: float = setting(
        200.0, "serve weights to members that fetch them at most this fast, in Mbit/s (default 200; 0: no limit)",
        metavar="MBITS")
    weights_busy_mbps: float = setting(
        40.0, "the same while requests run through this daemon, so activations keep priority (default 40)",
        metavar="MBITS")
    swarm_key: Path | None = setting(
        None, "make the swarm private: only peers holding this key (from `swarmd keygen`) can connect", metavar="FILE",
        default_text="none: an open swarm")
    allow_peers: tuple[str, ...] = setting(
        (), "accept only these peer ids (repeatable; with or without --swarm-key)", metavar="PEER_ID",
        option="--allow-peer", default_text="none: any peer")
    allow_peers_file: Path | None = setting(None, "more allowed peer ids, one per line (# starts a comment)",
                                            metavar="FILE")
    api_token: str = setting(
        "", "bearer token the HTTP API requires (also SWARMD_API_TOKEN); needed to bind --api off loopback; "
            "the web page at the API's root asks for it once",
        metavar="TOKEN", env="SWARMD_API_TOKEN", default_text="none: loopback only")
    api_max_request_bytes: int = setting(
        DEFAULT_MAX_REQUEST_BYTES, "the largest request body the HTTP API reads, e.g. 4MiB", metavar="SIZE",
        parse=parse_size, default_text="4MiB")
    api_max_tokens: int = setting(DEFAULT_MAX_TOKENS, "the most tokens one request may ask for", metavar="N")
    timings: Timings = setting(LAN, "timing preset: lan (default) or local-test", metavar="PRESET",
                               parse=parse_timings, default_text="lan")
    log_level: str = setting("info", "how much the daemon logs (default: info)", choices=LOG_LEVELS)

    def __post_init__(self) -> None:
        if self.wire_dtype not in WIRE_DTYPES:
            raise UserError(f"wire dtype {self.wire_dtype!r} is not one of float32 (lossless), float16, bfloat16")
        if self.expert_placement not in EXPERT_PLACEMENTS:
            raise UserError(f"expert placement {self.expert_placement!r} is not one of {', '.join(EXPERT_PLACEMENTS)}")
        if self.data_plane not in DATA_PLANES:
            raise UserError(f"data plane {self.data_plane!r} is not one of {', '.join(DATA_PLANES)}")
        if self.log_level not in LOG_LEVELS:
            raise UserError(f"log level {self.log_level!r} is not one of {', '.join(LOG_LEVELS)}")
        if self.weights_serve_mbps < 0 or self.weights_busy_mbps < 0:
            raise UserError("weights_serve_mbps and weights_busy_mbps must be 0 (no limit) or more")
        if self.inline_step_ms < 0:
            raise UserError("inline_step_ms must be 0 (off) or more")
        if self.max_requests < 1 or self.max_context < 2:
            raise UserError("max_requests must be at least 1 and max_context at least 2")
        try:
            SpecSettings(self.speculate, self.draft_tokens)
        except SpecError as e:
            raise UserError(f"--speculate / --draft-tokens: {e}") from None
        if not 0 <= self.data_plane_port < 65536:
            raise UserError(f"data-plane port {self.data_plane_port} is not a TCP port (0 picks a free one)")
        if self.claim_timeout <= 0:
            raise UserError("claim_timeout must be above 0 seconds")
        if self.max_queued < 0:
            raise UserError("max_queued must be 0 (no queue: refuse when no slot is free) or more")

    @property
    def planned_requests(self) -> int:
        """Requests whose KV caches the planner budgets on each stage; a stage then holds as many more as its
        memory allows, up to max_requests."""
        return min(self.max_requests, PLANNED_REQUESTS)

    def with_overrides(self, **changes: Any) -> DaemonConfig:
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


def warms_up(setting: bool | None, device: str) -> bool:
    """Whether a stage captures every jitted graph before it is ready: as set, else on GPUs only (there a batch
    size's first use would stall requests for seconds; on a CPU each graph costs many seconds at start)."""
    from models.kernels.matvec import GPU_DEVICES

    return setting if setting is not None else device.split(":")[0] in GPU_DEVICES


# --- what the fields give: options, TOML keys, environment, docs ------------------------------------------------


@dataclass(frozen=True)
class SettingField:
    """One `DaemonConfig` field as the command line, the config file and the docs see it."""

    name: str
    kind: type  # str, int, float, bool, Path, tuple (of str) or Timings
    optional: bool  # None is a value (unset: the daemon decides)
    default: Any
    how: Setting

    @property
    def option(self) -> str:
        return self.how.option or "--" + self.name.replace("_", "-")

    @property
    def key(self) -> str:
        return self.name.replace("_", "-")

    def convert(self, value: Any, source: str) -> Any:
        """A command-line string or a TOML value -> the field's value; a value that does not fit is a UserError."""
        if self.how.parse is not None:
            return self.how.parse(value)
        if self.kind is tuple:
            items = [value] if isinstance(value, str) else value
            if not isinstance(items, list | tuple) or not all(isinstance(v, str) for v in items):
                raise UserError(f"{source}: '{self.key}' must be a string or a list of strings")
            return tuple(items)
        if self.kind is bool:
            if not isinstance(value, bool):
                raise UserError(f"{source}: '{self.key}' must be true or false")
            return value
        if self.kind is Path:
            return Path(str(value)).expanduser()
        try:
            return self.kind(value)
        except (TypeError, ValueError):
            raise UserError(f"{source}: '{self.key}' must be {_KIND_NAMES.get(self.kind, 'a string')}, "
                            f"not {value!r}") from None


_KIND_NAMES = {int: "a whole number", float: "a number"}


@cache
def settings(config_class: type | None = None) -> tuple[SettingField, ...]:
    """Every field of `DaemonConfig` (or of `config_class`), in declaration order (that of `swarmd join --help`)."""
    cls = config_class or DaemonConfig
    hints = get_type_hints(cls)
    out = []
    for f in fields(cls):
        how = f.metadata.get("setting")
        if not isinstance(how, Setting):
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with setting(default, help): every setting "
                            "needs its help there (its option, TOML key and docs come from it)")
        kind, optional = _kind(hints[f.name])
        out.append(SettingField(f.name, kind, optional, _default(f), how))
    return tuple(out)


def _kind(hint: Any) -> tuple[type, bool]:
    args = getattr(hint, "__args__", ())
    if isinstance(hint, types.UnionType) and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        return _kind(inner)[0], True
    if getattr(hint, "__origin__", None) is tuple:
        return tuple, False
    return hint, False


def _default(f: Field) -> Any:
    return f.default_factory() if f.default_factory is not MISSING else f.default


def config_changes(doc: Mapping[str, Any], source: str = "config") -> dict[str, Any]:
    """A TOML document's keys (`swarmd join`'s long options, dashes or underscores) -> DaemonConfig changes."""
    by_key = {s.name: s for s in settings()}
    out: dict[str, Any] = {}
    for raw_key, value in doc.items():
        s = by_key.get(raw_key.replace("-", "_"))
        if s is None:
            raise UserError(f"{source}: unknown key '{raw_key}'")
        out[s.name] = s.convert(value, source)
    return out


def load_config_file(path: Path) -> dict[str, Any]:
    """Read a TOML file whose keys are `swarmd join`'s long options; return DaemonConfig changes."""
    try:
        doc = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"config file {path} is not valid TOML: {e}") from None
    return config_changes(doc, source=str(path))


def env_changes(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The settings set by environment variables: lists separated by commas or whitespace, text stripped."""
    out: dict[str, Any] = {}
    for s in settings():
        raw = environ.get(s.how.env, "").strip() if s.how.env else ""
        if raw:
            value = tuple(a for a in re.split(r"[,\s]+", raw) if a) if s.kind is tuple else raw
            out[s.name] = s.convert(value, s.how.env)
    return out


def api_token_from_env() -> str:
    """SWARMD_API_TOKEN: the API's bearer token, for the daemon and for the CLI clients alike."""
    return env_changes().get("api_token", "")


def settings_markdown() -> str:
    """docs/SETTINGS.md: every setting and timing, as the fields declare them."""
    lines = ["# Settings", "",
             "<!-- Made from swarmd/config.py by `python scripts/settings_doc.py`; a test checks it is current. -->",
             "", "Every `swarmd join` option is also a key of its TOML config file (`--config FILE`; dashes or",
             "underscores), and a few can come from the environment. The command line wins over the environment,",
             "which wins over the config file, which wins over the defaults.", "",
             "| `swarmd join` | TOML key | environment | default | what it does |", "|---|---|---|---|---|"]
    for s in settings():
        metavar = "" if s.kind is bool else " " + (s.how.metavar or (
            "{" + ",".join(s.how.choices) + "}" if s.how.choices else s.name.upper()))
        flag = f"--[no-]{s.key}" if s.kind is bool and s.optional else s.option
        lines.append(f"| `{flag}{metavar}` | `{s.key}` | {f'`{s.how.env}`' if s.how.env else ''} | "
                     f"{_shown(s)} | {_cell(s.how.help)} |")
    lines += ["", "## Timings", "",
              "`timings` in the config file is a preset name or a table: `preset` and any of these keys (seconds).", "",
              "| key | lan | local-test | what it is |", "|---|---|---|---|"]
    for f in fields(Timings):
        how = f.metadata.get("setting")
        if not isinstance(how, Setting) or not how.help:
            raise TypeError(f"Timings.{f.name} is not declared with timing(default, help)")
        lines.append(f"| `{f.name.replace('_', '-')}` | {getattr(LAN, f.name):g} | {getattr(LOCAL_TEST, f.name):g} | "
                     f"{_cell(how.help)} |")
    return "\n".join(lines) + "\n"


def _shown(s: SettingField) -> str:
    if s.how.default_text:
        return s.how.default_text
    if s.kind is bool:
        return "on" if s.default else "off"
    if s.kind is tuple:
        return ", ".join(f"`{v}`" for v in s.default) or "none"
    return f"`{s.default}`" if s.default not in (None, "") else "none"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")
