"""Every timing and setting of a daemon in one place: presets for the timings, TOML for the rest.

Timings follow memberlist's habit: one frozen object with named presets (LAN for real use,
LOCAL_TEST for fast tests on one machine) instead of literals scattered through the code.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from swarmd.errors import UserError


@dataclass(frozen=True)
class Timings:
    """Seconds, all of them."""

    heartbeat_interval: float = 1.0  # a signed descriptor on the gossip topic this often
    suspect_after: float = 3.0  # silence after which a member is suspect (scaled by log N)
    probe_timeout: float = 1.0  # a direct probe slower than this failed
    probe_interval: float = 2.0  # routine direct probes (RTT and hung-peer detection)
    dead_retention: float = 60.0  # how long a dead member stays in status before it is forgotten
    replan_debounce: float = 1.0  # membership quiet for this long before the leader re-plans
    replan_after_loss: float = 0.1  # the debounce when a member holding a stage is gone (the chain is broken)
    plan_republish_interval: float = 3.0  # the leader repeats its plan for late joiners
    dial_backoff_initial: float = 0.5  # first retry of a failed dial (bootstrap, members)
    dial_backoff_max: float = 8.0
    dial_timeout: float = 5.0
    leave_grace: float = 0.5  # after publishing a leave, time for it to spread before closing
    # requests through the pipeline
    ready_timeout: float = 120.0  # a request waits this long for the plan's stages to be ready
    first_token_timeout: float = 900.0  # a prefill on a cold kernel cache compiles for minutes on a small CPU
    token_timeout: float = 120.0  # the longest wait for the next token once the first came
    request_idle_timeout: float = 1800.0  # a stage frees a request whose head has said nothing for this long
    cancel_timeout: float = 10.0  # how long the head tries to tell a stage that a request is over
    drain_timeout: float = 60.0  # a daemon leaving on purpose waits this long for the requests it heads

    def suspicion_timeout(self, n_members: int) -> float:
        """memberlist's rule: suspicion grows with log10 of the swarm size, never below the base."""
        return self.suspect_after * max(1.0, math.log10(max(1, n_members)))


LAN = Timings()
LOCAL_TEST = Timings(
    heartbeat_interval=0.25,
    suspect_after=1.0,
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


def default_home() -> Path:
    return Path(os.environ.get("SWARMD_HOME") or Path.home() / ".swarmd")


@dataclass(frozen=True)
class DaemonConfig:
    """What `swarmd join` runs with: command line over environment over config file over defaults."""

    swarm: str = DEFAULT_SWARM
    listen: tuple[str, ...] = (DEFAULT_LISTEN,)
    announce: tuple[str, ...] = ()
    bootstrap: tuple[str, ...] = ()
    model: str = DEFAULT_MODEL
    api: str = DEFAULT_API
    home: Path = field(default_factory=default_home)
    device: str = "auto"
    memory_limit: int | None = None  # bytes
    device_label: str = ""
    mdns: bool = False
    uplink_mbps: float | None = None  # None: read the interface speed, else 1000
    plan: Path | None = None  # a Plan JSON file the founding daemon adopts instead of planning
    standby: bool = False  # a spare: the planner gives it a warm copy of a stage instead of a stage
    full_replay: bool = False  # requests this daemon heads move by replaying every stage (no hop-local rebuild)
    full_reload: bool = False  # a new block range is read whole, not built on the loaded stage's blocks
    warmup: bool | None = None  # capture every jitted graph before the stage is ready; None: on GPUs only
    max_context: int = 2048
    max_requests: int = 4  # KV cache slots of this daemon's stage: requests it can hold at once
    wire_dtype: str = ""  # "" sends activations in their compute dtype (lossless); or float16, bfloat16
    inline_step_ms: float = 50.0  # a decode step seen to take at most this long runs on the event loop's thread
    expert_placement: str = "auto"  # MoE: the planner's choice, or "spread" / "local" (PlanOptions.expert_placement)
    data_plane: str = "tls"  # tls (pinned TLS sockets for tensors) or libp2p (everything on libp2p streams)
    data_plane_port: int = 0  # the TLS data plane's TCP port (0: any free one); forward it with the libp2p one
    relay_service: bool = True  # serve circuit relay v2 to the swarm (used when this daemon is reachable)
    relays: tuple[str, ...] = ()  # relays to keep a reservation on when not reachable, besides members
    hole_punching: bool = True  # DCUtR with members reached only through a relay
    swarm_key: Path | None = None  # a private swarm: only peers holding this key can connect
    allow_peers: tuple[str, ...] = ()  # if any: only these peer ids may connect (besides the key)
    allow_peers_file: Path | None = None  # more allowed peer ids, one per line
    api_token: str = ""  # bearer token the API wants on every route but /health; required off loopback
    api_max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    api_max_tokens: int = DEFAULT_MAX_TOKENS
    timings: Timings = LAN
    log_level: str = "info"

    @property
    def founds_swarm(self) -> bool:
        return not self.bootstrap

    def __post_init__(self) -> None:
        if self.wire_dtype not in WIRE_DTYPES:
            raise UserError(f"wire dtype {self.wire_dtype!r} is not one of float32 (lossless), float16, bfloat16")
        if self.expert_placement not in EXPERT_PLACEMENTS:
            raise UserError(f"expert placement {self.expert_placement!r} is not one of {', '.join(EXPERT_PLACEMENTS)}")
        if self.data_plane not in DATA_PLANES:
            raise UserError(f"data plane {self.data_plane!r} is not one of {', '.join(DATA_PLANES)}")
        if self.inline_step_ms < 0:
            raise UserError("inline_step_ms must be 0 (off) or more")
        if self.max_requests < 1 or self.max_context < 2:
            raise UserError("max_requests must be at least 1 and max_context at least 2")
        if not 0 <= self.data_plane_port < 65536:
            raise UserError(f"data-plane port {self.data_plane_port} is not a TCP port (0 picks a free one)")

    def with_overrides(self, **changes: Any) -> DaemonConfig:
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


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


def warms_up(setting: bool | None, device: str) -> bool:
    """Whether a stage captures every jitted graph before it is ready: as set, else on GPUs only (there a batch
    size's first use would stall requests for seconds; on a CPU each graph costs many seconds at start)."""
    from models.kernels.matvec import GPU_DEVICES

    return setting if setting is not None else device.split(":")[0] in GPU_DEVICES


def _preset(name: str) -> Timings:
    try:
        return PRESETS[name.lower()]
    except KeyError:
        raise UserError(f"unknown timings preset {name!r} (known: {', '.join(PRESETS)})") from None


_LIST_KEYS = {"listen", "announce", "bootstrap", "allow_peers", "relay"}
_STR_KEYS = {"swarm", "model", "api", "device", "device_label", "log_level", "wire_dtype", "data_plane",
             "api_token", "expert_placement"}
EXPERT_PLACEMENTS = ("auto", "spread", "local")
WIRE_DTYPES = ("", "float32", "float16", "bfloat16")
DATA_PLANES = ("tls", "libp2p")


def load_config_file(path: Path) -> dict[str, Any]:
    """Read a TOML file whose keys are `swarmd join`'s long options; return DaemonConfig changes."""
    try:
        doc = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"config file {path} is not valid TOML: {e}") from None
    return config_changes(doc, source=str(path))


def config_changes(doc: dict[str, Any], source: str = "config") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for raw_key, value in doc.items():
        key = raw_key.replace("-", "_")
        if key in _LIST_KEYS:
            items = [value] if isinstance(value, str) else value
            if not isinstance(items, list) or not all(isinstance(v, str) for v in items):
                raise UserError(f"{source}: '{raw_key}' must be a string or a list of strings")
            out["relays" if key == "relay" else key] = tuple(items)
        elif key in _STR_KEYS:
            out[key] = str(value)
        elif key in ("home", "plan", "swarm_key", "allow_peers_file"):
            out[key] = Path(str(value)).expanduser()
        elif key == "memory_limit":
            out[key] = parse_size(value)
        elif key in ("mdns", "standby", "full_replay", "full_reload", "warmup", "relay_service", "hole_punching"):
            out[key] = bool(value)
        elif key in ("uplink_mbps", "inline_step_ms"):
            out[key] = float(value)
        elif key in ("max_context", "max_requests", "api_max_tokens", "data_plane_port"):
            out[key] = int(value)
        elif key == "api_max_request_bytes":
            out[key] = parse_size(value)
        elif key == "timings":
            out[key] = parse_timings(value)
        else:
            raise UserError(f"{source}: unknown key '{raw_key}'")
    return out


def api_token_from_env() -> str:
    """SWARMD_API_TOKEN: the API's bearer token, for the daemon and for the CLI clients alike."""
    return os.environ.get("SWARMD_API_TOKEN", "").strip()


def bootstrap_from_env() -> tuple[str, ...]:
    """SWARMD_BOOTSTRAP: addresses separated by commas or whitespace."""
    raw = os.environ.get("SWARMD_BOOTSTRAP", "")
    return tuple(a for a in re.split(r"[,\s]+", raw) if a)
