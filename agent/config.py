"""Agent configuration: CLI flags over environment variables over defaults, validated once."""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from agent.lending import LendingPolicy, PolicyError, load_policy_file, policy_with_flags
from agent.protocol import COMMAND_MAX_AGE_SECONDS

DEFAULT_RPC_PORT = 50052
DEFAULT_DRAIN_SECONDS = 10.0
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class ConfigError(ValueError):
    """A configuration value is wrong. Its message is one line meant for the operator."""


# The relay's coalescing window (agent/runtime/stream.py, docs/design/serving.md): the longest a
# fast stream's token waits in the agent for others. Read from the environment only.
COALESCE_ENV = "RACON_STREAM_COALESCE_SECONDS"
# The same while the engine is busy (STREAM_COALESCE_BUSY_STREAMS jobs or more on one primary):
# then every entry's CPU in the agent, Redis and the controller is taken from the engine.
COALESCE_BUSY_ENV = "RACON_STREAM_COALESCE_BUSY_SECONDS"
COALESCE_DEFAULTS = {COALESCE_ENV: 0.02, COALESCE_BUSY_ENV: 0.1}  # seconds
MAX_COALESCE_SECONDS = 1.0


def stream_coalesce_seconds(raw: str | None, *, name: str = COALESCE_ENV) -> float:
    """A coalescing window's value as seconds ('' or unset: its default, COALESCE_DEFAULTS);
    ConfigError naming the variable for anything but a number from 0 to 1."""
    if not raw:
        return COALESCE_DEFAULTS[name]
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds, got {raw!r}") from None
    if not 0 <= value <= MAX_COALESCE_SECONDS:  # NaN fails this too
        raise ConfigError(
            f"{name} must be between 0 and {MAX_COALESCE_SECONDS:g} seconds, got {raw!r}"
        )
    return value


@dataclass
class AgentConfig:
    controller_url: str
    node_name: str
    state_dir: Path
    models_dir: Path
    advertise_address: str
    enrollment_token: str | None = None
    rpc_port: int = DEFAULT_RPC_PORT
    hardware_profile: Path | None = None
    metrics_port: int | None = None
    rpc_worker: bool = True
    drain_seconds: float = DEFAULT_DRAIN_SECONDS
    # Overrides the Redis URL the controller hands out at enrollment (useful behind NAT/tunnels).
    redis_url: str | None = None
    # The controller's own CA (--ca-file, RACON_CA_FILE; the join line passes it): copied into the
    # state dir, where a restarted agent finds it (agent/client.py controller_ca).
    ca_file: Path | None = None
    # Threads for the RPC worker; 0 means "all logical cores".
    rpc_threads: int = 0
    run_benchmarks: bool = True
    log_level: str = "INFO"
    # The owner's lending terms (agent/lending.py): --policy FILE, then the lending flags.
    lending: LendingPolicy = field(default_factory=LendingPolicy)
    # A command issued longer ago than this is refused (agent/envelope.py, the replay window).
    command_max_age: float = COMMAND_MAX_AGE_SECONDS

    @property
    def rpc_endpoint(self) -> str:
        host = self.advertise_address
        if ":" in host:  # IPv6 literal
            host = f"[{host}]"
        return f"{host}:{self.rpc_port}"

    @property
    def identity_path(self) -> Path:
        return self.state_dir / "identity.json"

    @property
    def pid_path(self) -> Path:
        return self.state_dir / "agent.pid"

    @property
    def log_path(self) -> Path:
        return self.state_dir / "agent.log"

    @property
    def status_path(self) -> Path:
        return self.state_dir / "status.json"


def default_state_dir(env: Mapping[str, str]) -> Path:
    base = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "racon-agent"


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the run command. Every default is None so the environment can fill the gap."""
    parser.add_argument("--foreground", action="store_true", help="run attached to the terminal")
    parser.add_argument("--controller-url", help="controller base URL (RACON_CONTROLLER_URL)")
    parser.add_argument(
        "--enrollment-token",
        help="administrator-issued token; prefer RACON_ENROLLMENT_TOKEN (argv is visible to every "
        "local user)",
    )
    parser.add_argument("--node-name", help="name shown in the controller (RACON_NODE_NAME)")
    parser.add_argument("--models-dir", help="where GGUF files live (RACON_MODELS_DIR)")
    parser.add_argument(
        "--advertise-address",
        help="private address peers reach this node on (RACON_ADVERTISE_ADDRESS)",
    )
    parser.add_argument("--rpc-port", help="ggml-rpc port, default 50052 (RACON_RPC_PORT)")
    parser.add_argument("--state-dir", help="credential, caches, logs (RACON_STATE_DIR)")
    parser.add_argument(
        "--hardware-profile", help="JSON file that replaces hardware detection (testing)"
    )
    parser.add_argument("--metrics-port", help="serve Prometheus metrics on this port")
    parser.add_argument(
        "--no-rpc-worker", action="store_true", help="do not lend memory as a ggml-rpc worker"
    )
    parser.add_argument(
        "--drain-seconds", help="SIGTERM: bound on finishing current work (RACON_DRAIN_SECONDS)"
    )
    parser.add_argument("--redis-url", help="override the Redis URL given at enrollment")
    parser.add_argument(
        "--ca-file",
        help="the controller's CA certificate (PEM) to check https and rediss against; kept in "
        "the state dir (RACON_CA_FILE)",
    )
    parser.add_argument(
        "--command-max-age",
        help="refuse a command issued longer ago than this, seconds, default 600 "
        "(RACON_COMMAND_MAX_AGE)",
    )
    parser.add_argument("--no-benchmark", action="store_true", help="skip compute benchmarks")
    parser.add_argument("--log-level", help="DEBUG, INFO, WARNING (RACON_LOG_LEVEL)")
    lend = parser.add_argument_group("lending (agent/lending.py; flags override --policy)")
    lend.add_argument("--policy", help="lending policy file, TOML or JSON (RACON_POLICY)")
    lend.add_argument(
        "--window",
        action="append",
        help="lend only in this window, e.g. 'mon-fri 19:00-08:00' (repeatable)",
    )
    lend.add_argument("--timezone", help="time zone of the windows, e.g. Europe/Paris")
    lend.add_argument("--idle-minutes", help="lend only after this long without user input")
    lend.add_argument("--idle-cpu-below", help="lend only while other processes' CPU is below %%")
    lend.add_argument("--max-ram-gb", help="most RAM to lend, GB")
    lend.add_argument("--max-vram-gb", help="most VRAM to lend, GB (all GPUs together)")
    lend.add_argument("--max-threads", help="most CPU threads to lend")
    lend.add_argument("--handoff", help="what a pause does to running jobs: failover or finish")


def _pick(cli: object, env: Mapping[str, str], name: str) -> str | None:
    value = getattr(cli, name, None)
    if value is None or value == "":
        value = env.get("RACON_" + name.upper())
    return value if value not in (None, "") else None


def _port(value: str, flag: str) -> int:
    try:
        port = int(value)
    except ValueError:
        raise ConfigError(f"{flag} must be a port number, got {value!r}") from None
    if not 0 < port < 65536:
        raise ConfigError(f"{flag} must be between 1 and 65535, got {port}")
    return port


def _validate_url(url: str, flag: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{flag} must be an http(s) URL like http://10.0.0.5:8000, got {url!r}")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise ConfigError(f"{flag} has an invalid port: {url!r}") from None
    return url.rstrip("/")


def _validate_address(value: str) -> str:
    if value == "localhost":
        return "127.0.0.1"
    try:
        return str(ipaddress.ip_address(value.strip("[]")))
    except ValueError:
        raise ConfigError(
            f"--advertise-address must be an IP address of this machine, got {value!r}"
        ) from None


def guess_advertise_address(controller_url: str) -> str:
    """The local address the OS would use to reach the controller (no packet is sent)."""
    host = urlsplit(controller_url).hostname or "127.0.0.1"
    try:
        infos = socket.getaddrinfo(host, 80, type=socket.SOCK_DGRAM)
        family, _, _, _, sockaddr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(sockaddr)  # UDP connect only picks a route
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def _check_advertise_reachable(advertise: str, controller_url: str) -> None:
    """A controller on another machine hands this node's address to primaries elsewhere: a
    loopback or link-local one would have them dial themselves (or a LAN service)."""
    host = (urlsplit(controller_url).hostname or "").strip("[]")
    try:
        remote = not ipaddress.ip_address(host).is_loopback
    except ValueError:
        remote = host != "localhost"
    addr = ipaddress.ip_address(advertise)
    if remote and (addr.is_loopback or addr.is_link_local):
        kind = "loopback" if addr.is_loopback else "link-local"
        raise ConfigError(
            f"--advertise-address {advertise} is {kind}, but the controller {controller_url} is "
            "on another machine: peers could never reach this node there; give this machine's "
            "LAN address (or leave it out: the address that reaches the controller is used)"
        )


def stored_controller_url(state_dir: Path) -> str | None:
    """The controller URL the node in state_dir enrolled with (identity.json), or None."""
    try:
        raw = json.loads((state_dir / "identity.json").read_text())
    except (OSError, ValueError):
        return None
    url = raw.get("controller_url") if isinstance(raw, dict) else None
    return url if isinstance(url, str) and url else None


def config_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> AgentConfig:
    """Build and validate the config. Raises ConfigError with a one-line message."""
    env = os.environ if env is None else env
    controller_url = _pick(args, env, "controller_url")
    if not controller_url:
        # A restarted agent knows where it enrolled: the URL is stored with its credential.
        controller_url = stored_controller_url(
            Path(_pick(args, env, "state_dir") or default_state_dir(env)).expanduser()
        )
    if not controller_url:
        raise ConfigError(
            "--controller-url (or RACON_CONTROLLER_URL) is required: this state dir holds no "
            "enrolled node"
        )
    controller_url = _validate_url(controller_url, "--controller-url")

    node_name = _pick(args, env, "node_name") or socket.gethostname().split(".")[0]
    if not _NAME_RE.match(node_name):
        raise ConfigError(
            f"--node-name must be 1-63 letters, digits, '.', '_' or '-', got {node_name!r}"
        )

    state_dir = Path(_pick(args, env, "state_dir") or default_state_dir(env)).expanduser()
    models_dir = Path(_pick(args, env, "models_dir") or state_dir / "models").expanduser()
    if models_dir.exists() and not models_dir.is_dir():
        raise ConfigError(f"--models-dir {models_dir} exists and is not a directory")
    if state_dir.exists() and not state_dir.is_dir():
        raise ConfigError(f"--state-dir {state_dir} exists and is not a directory")

    address = _pick(args, env, "advertise_address")
    advertise = _validate_address(address) if address else guess_advertise_address(controller_url)
    _check_advertise_reachable(advertise, controller_url)

    rpc_port_raw = _pick(args, env, "rpc_port")
    rpc_port = _port(rpc_port_raw, "--rpc-port") if rpc_port_raw else DEFAULT_RPC_PORT

    metrics_raw = _pick(args, env, "metrics_port")
    metrics_port = _port(metrics_raw, "--metrics-port") if metrics_raw else None
    if metrics_port is not None and metrics_port == rpc_port:
        raise ConfigError("--metrics-port must differ from --rpc-port")

    profile_raw = _pick(args, env, "hardware_profile")
    profile = Path(profile_raw).expanduser() if profile_raw else None
    if profile is not None and not profile.is_file():
        raise ConfigError(f"--hardware-profile {profile} is not a readable file")

    drain_raw = _pick(args, env, "drain_seconds")
    drain = DEFAULT_DRAIN_SECONDS
    if drain_raw:
        try:
            drain = float(drain_raw)
        except ValueError:
            raise ConfigError(f"--drain-seconds must be a number, got {drain_raw!r}") from None
        if not 0 <= drain <= 3600:
            raise ConfigError(f"--drain-seconds must be between 0 and 3600, got {drain}")

    max_age_raw = _pick(args, env, "command_max_age")
    max_age = COMMAND_MAX_AGE_SECONDS
    if max_age_raw:
        try:
            max_age = float(max_age_raw)
        except ValueError:
            raise ConfigError(
                f"--command-max-age must be a number of seconds, got {max_age_raw!r}"
            ) from None
        if not 5 <= max_age <= 86400:
            raise ConfigError(f"--command-max-age must be between 5 and 86400, got {max_age:g}")

    ca_raw = _pick(args, env, "ca_file")
    ca_file = Path(ca_raw).expanduser() if ca_raw else None
    if ca_file is not None:
        try:
            pem = ca_file.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--ca-file {ca_file} cannot be read: {exc}") from None
        if "-----BEGIN CERTIFICATE-----" not in pem:
            raise ConfigError(f"--ca-file {ca_file} holds no PEM certificate")

    redis_url = _pick(args, env, "redis_url")
    if redis_url and urlsplit(redis_url).scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(f"--redis-url must be a redis:// URL, got {redis_url!r}")

    for name in COALESCE_DEFAULTS:  # refused here, at start, naming them
        stream_coalesce_seconds(env.get(name), name=name)

    level = (_pick(args, env, "log_level") or "INFO").upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise ConfigError(f"--log-level must be DEBUG, INFO, WARNING or ERROR, got {level!r}")

    rpc_worker = not getattr(args, "no_rpc_worker", False)
    if env.get("RACON_NO_RPC_WORKER", "").lower() in ("1", "true", "yes"):
        rpc_worker = False

    policy_raw = _pick(args, env, "policy")
    try:
        lending = load_policy_file(Path(policy_raw).expanduser()) if policy_raw else LendingPolicy()
        lending = policy_with_flags(
            lending,
            {
                "windows": getattr(args, "window", None),
                "timezone": getattr(args, "timezone", None),
                "idle_minutes": getattr(args, "idle_minutes", None),
                "cpu_below": getattr(args, "idle_cpu_below", None),
                "ram_gb": getattr(args, "max_ram_gb", None),
                "vram_gb": getattr(args, "max_vram_gb", None),
                "threads": getattr(args, "max_threads", None),
                "handoff": getattr(args, "handoff", None),
            },
        )
    except PolicyError as exc:
        raise ConfigError(f"lending policy: {exc}") from None

    return AgentConfig(
        controller_url=controller_url,
        node_name=node_name,
        state_dir=state_dir,
        models_dir=models_dir,
        advertise_address=advertise,
        enrollment_token=_pick(args, env, "enrollment_token"),
        rpc_port=rpc_port,
        hardware_profile=profile,
        metrics_port=metrics_port,
        rpc_worker=rpc_worker,
        drain_seconds=drain,
        redis_url=redis_url,
        ca_file=ca_file,
        run_benchmarks=not getattr(args, "no_benchmark", False),
        log_level=level,
        lending=lending,
        command_max_age=max_age,
    )


def parse_run_args(argv: Sequence[str], env: Mapping[str, str] | None = None) -> AgentConfig:
    """Parse run flags (used by tests and by programmatic callers)."""
    parser = argparse.ArgumentParser(prog="node-agent")
    add_run_arguments(parser)
    return config_from_args(parser.parse_args(list(argv)), env)
