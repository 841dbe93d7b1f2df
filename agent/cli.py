"""`node-agent`: lend this machine to a RACoN controller. `node-agent --help` lists the commands.

RACON_ENROLLMENT_TOKEN=TOKEN node-agent [run] --foreground --controller-url URL --node-name NAME
node-agent doctor | status | stop | pause | resume | upgrade | install-service | uninstall-service
Every command's `--help` shows its options and an example; an unknown command or flag gets one
line naming the closest valid one.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import redis

from agent import __version__
from agent.agent import Agent
from agent.bundle import BundleError, bundle_home, restart_service, upgrade_bundle
from agent.client import ControllerClient
from agent.config import (
    AgentConfig,
    ConfigError,
    add_run_arguments,
    config_from_args,
    default_state_dir,
)
from agent.hardware import hardware_source
from agent.hardware.devices import describe as describe_devices
from agent.hardware.gpu_benchmark import doctor_check
from agent.identity import IdentityError, load_identity, write_private_file
from agent.lending import HANDOFFS, lending_status_path, pause_path, read_json
from agent.models import ShaCache, scan_models
from agent.runtime.llama import llama_rpc_support
from agent.service import UNIT_NAME, install_service, uninstall_service, unit_path
from agent.upgrade import UpgradeError, upgrade

# (command, one line for `node-agent --help`, an example for its own --help), in that order.
COMMANDS: tuple[tuple[str, str, str], ...] = (
    (
        "run",
        "run the agent: enroll, lend this machine, take jobs (the default command)",
        "node-agent run --foreground --controller-url https://10.0.0.5:8000 --node-name desk-1 "
        "(the first run reads the token from RACON_ENROLLMENT_TOKEN, never argv)",
    ),
    (
        "doctor",
        "check hardware, controller, Redis, llama.cpp and models; --bundle for a bug report",
        "node-agent doctor --controller-url https://10.0.0.5:8000 --bundle doctor.tar.gz",
    ),
    ("status", "show whether the agent runs, its node, state and jobs", "node-agent status"),
    ("stop", "stop a detached agent (it drains its work first)", "node-agent stop --timeout 60"),
    (
        "pause",
        "stop lending now: the node drains; running jobs fail over or finish",
        "node-agent pause --handoff finish",
    ),
    ("resume", "lend again after a pause", "node-agent resume"),
    (
        "install-service",
        "write a systemd unit that runs the agent, and enable it",
        "node-agent install-service --user --controller-url https://10.0.0.5:8000 --max-threads 4",
    ),
    (
        "uninstall-service",
        "stop and remove that systemd unit",
        "node-agent uninstall-service --user",
    ),
    (
        "upgrade",
        "install the controller's current agent and llama.cpp, then restart the service",
        "node-agent upgrade",
    ),
)
SUBCOMMANDS = tuple(name for name, _, _ in COMMANDS)
_SUMMARY = {name: summary for name, summary, _ in COMMANDS}
_EXAMPLE = {name: example for name, _, example in COMMANDS}


def top_help() -> str:
    """`node-agent --help`: every command with one line, then where to read more."""
    width = max(len(name) for name in SUBCOMMANDS) + 2
    lines = [
        "usage: node-agent [COMMAND] [options]      (no command: run)",
        "",
        "Lend this machine's CPU, RAM and GPU to a RACoN controller.",
        "",
        "commands:",
        *(f"  {name.ljust(width)}{summary}" for name, summary, _ in COMMANDS),
        "",
        "options:",
        "  -h, --help    show this list; `node-agent COMMAND --help` shows a command's options",
        "  --version     print the agent's version",
        "",
        "example:",
        f"  {_EXAMPLE['run']}",
    ]
    return "\n".join(lines) + "\n"


def closest(word: str, choices: Sequence[str]) -> str | None:
    """The valid spelling nearest to `word` (difflib), or None when nothing is close."""
    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return found[0] if found else None


class Parser(argparse.ArgumentParser):
    """argparse with an example under --help and one-line errors that name the closest flag."""

    def __init__(self, command: str, **kw: Any) -> None:
        super().__init__(
            prog=f"node-agent {command}",
            description=_SUMMARY.get(command),
            epilog=f"example:\n  {_EXAMPLE[command]}" if command in _EXAMPLE else None,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            **kw,
        )

    def error(self, message: str) -> Any:  # argparse's signature (NoReturn)
        print(
            f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)",
            file=sys.stderr,
        )
        raise SystemExit(2)

    def parse(self, argv: Sequence[str]) -> argparse.Namespace:
        args, extra = self.parse_known_args(list(argv))
        if extra:
            word = extra[0]
            if word.startswith("-"):
                flag = word.split("=", 1)[0]
                near = closest(flag, [o for o in self._option_string_actions if o.startswith("--")])
                hint = f"; did you mean {near}?" if near else ""
                self.error(f"unknown flag {flag}{hint}")
            self.error(f"unexpected argument {word!r}")
        return args


def _error(message: str, code: int = 2) -> int:
    print(f"node-agent: error: {message}", file=sys.stderr)
    return code


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise


# --- pid file ------------------------------------------------------------------------------------


def read_pid(path: Path) -> int | None:
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return pid
    return pid


def _claim_pid_file(config: AgentConfig) -> str | None:
    other = read_pid(config.pid_path)
    if other is not None and other != os.getpid():
        return f"an agent is already running with state dir {config.state_dir} (pid {other})"
    config.state_dir.mkdir(parents=True, exist_ok=True)
    config.pid_path.write_text(f"{os.getpid()}\n")
    return None


# --- run -----------------------------------------------------------------------------------------


def cmd_run(argv: Sequence[str]) -> int:
    parser = Parser("run")
    parser.add_argument("--version", action="version", version=f"node-agent {__version__}")
    add_run_arguments(parser)
    args = parser.parse(argv)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        return _error(str(exc))
    if not args.foreground:
        return _detach(config, argv)
    _setup_logging(config.log_level)
    problem = _claim_pid_file(config)
    if problem:
        return _error(problem)
    try:
        agent = Agent(config)
        code = agent.run()
    except ConfigError as exc:
        code = _error(str(exc))
    finally:
        try:
            if read_pid(config.pid_path) == os.getpid():
                config.pid_path.unlink()
        except OSError:
            pass
    return code


def _detach(config: AgentConfig, argv: Sequence[str]) -> int:
    """Start `node-agent --foreground ...` in its own session with output to the log file."""
    other = read_pid(config.pid_path)
    if other is not None:
        return _error(
            f"an agent is already running with state dir {config.state_dir} (pid {other})"
        )
    config.state_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "agent.cli", *argv, "--foreground"]
    if "--state-dir" not in argv:
        cmd += ["--state-dir", str(config.state_dir)]
    with open(config.log_path, "ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # survives the terminal closing; no controlling tty
            close_fds=True,
        )
    # A bad credential or config fails fast; report that here instead of a silent dead daemon.
    for _ in range(30):
        time.sleep(0.1)
        if proc.poll() is not None:
            tail = config.log_path.read_text(errors="replace").splitlines()[-5:]
            print("\n".join(tail), file=sys.stderr)
            return _error(
                f"agent exited at start (code {proc.returncode}); log: {config.log_path}", 1
            )
    print(f"node-agent started (pid {proc.pid}); log: {config.log_path}")
    return 0


# --- status / stop -------------------------------------------------------------------------------


def _state_dir_arg(argv: Sequence[str], prog: str) -> argparse.Namespace:
    p = Parser(prog)
    p.add_argument("--state-dir", help="the agent's state dir (RACON_STATE_DIR)")
    if prog == "stop":
        p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the drain")
    if prog == "doctor":
        p.add_argument("--controller-url", help="controller to check (default: the stored one)")
        p.add_argument("--models-dir", help="models dir (RACON_MODELS_DIR)")
        p.add_argument("--hardware-profile", help="JSON profile instead of detection")
        p.add_argument("--bundle", help="write a .tar.gz with the report and recent logs")
        p.add_argument("--no-benchmark", action="store_true", help="skip compute benchmarks")
    return p.parse(argv)


def _resolve_state_dir(args: argparse.Namespace) -> Path:
    raw = args.state_dir or os.environ.get("RACON_STATE_DIR")
    return Path(raw).expanduser() if raw else default_state_dir(os.environ)


def cmd_status(argv: Sequence[str]) -> int:
    args = _state_dir_arg(argv, "status")
    state_dir = _resolve_state_dir(args)
    pid = read_pid(state_dir / "agent.pid")
    try:
        ident = load_identity(state_dir)
    except IdentityError as exc:
        ident = None
        print(f"identity: unreadable ({exc})")
    print(f"state dir: {state_dir}")
    print(f"process: {f'running (pid {pid})' if pid else 'not running'}")
    if ident:
        print(f"node: {ident.node_id} ({ident.node_name}) enrolled with {ident.controller_url}")
    else:
        print("node: not enrolled")
    try:
        status = json.loads((state_dir / "status.json").read_text())
    except (OSError, ValueError):
        status = None
    if status:
        age = time.time() - float(status.get("updated_at", 0))
        print(
            f"state: {status.get('state')} (controller: {status.get('controller_state')}, {age:.0f}s ago)"
        )
        rw = status.get("rpc_worker", {})
        print(
            f"rpc worker: {'running on ' + str(rw.get('endpoint')) if rw.get('running') else 'stopped'}"
        )
        print(f"primaries: {', '.join(status.get('primaries', [])) or 'none'}")
        print(f"jobs: {', '.join(status.get('jobs', [])) or 'none'}")
    return 0 if pid else 1


def cmd_stop(argv: Sequence[str]) -> int:
    args = _state_dir_arg(argv, "stop")
    state_dir = _resolve_state_dir(args)
    pid = read_pid(state_dir / "agent.pid")
    if pid is None:
        print("node-agent is not running")
        return 0
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            print(f"node-agent (pid {pid}) stopped")
            return 0
        time.sleep(0.2)
    return _error(f"node-agent (pid {pid}) still draining after {args.timeout:.0f}s", 1)


# --- upgrade -------------------------------------------------------------------------------------


def cmd_upgrade(argv: Sequence[str]) -> int:
    args = _state_dir_arg(argv, "upgrade")
    state_dir = _resolve_state_dir(args)
    try:
        ident = load_identity(state_dir)
    except IdentityError as exc:
        return _error(str(exc))
    if ident is None:
        return _error(f"not enrolled (no identity in {state_dir}): run the join line instead")
    home = bundle_home()
    try:
        if home is not None:  # the standalone bundle: a new one beside it, the link switched
            version = upgrade_bundle(ident, home, ca_file=state_dir / "controller-ca.pem")
        else:
            version = upgrade(ident)
    except (UpgradeError, BundleError, httpx.HTTPError, OSError) as exc:
        return _error(str(exc), 1)
    if not version:
        print(f"node-agent: already the controller's agent ({__version__})")
        return 0
    print(f"node-agent: upgraded {__version__} -> {version} from {ident.controller_url}")
    for user in (True, False):
        if unit_path(user=user).exists():
            print(f"node-agent: {restart_service(UNIT_NAME, user=user)}")
            return 0
    running = read_pid(state_dir / "agent.pid")
    if running:
        print(f"node-agent: the running agent (pid {running}) runs the old code until restarted")
    return 0


# --- pause / resume (agent/lending.py) ------------------------------------------------------------


def _lending_args(argv: Sequence[str], prog: str) -> argparse.Namespace:
    p = Parser(prog)
    p.add_argument("--state-dir", help="the agent's state dir (RACON_STATE_DIR)")
    if prog == "pause":
        p.add_argument(
            "--handoff",
            choices=HANDOFFS,
            help="running jobs: failover (to other replicas, now) or finish (here); "
            "default: the policy's",
        )
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the agent")
    return p.parse(argv)


def _await_lending(state_dir: Path, *, paused: bool, request: str | None, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = read_json(lending_status_path(state_dir)) or {}
        if bool(st.get("paused")) == paused and (request is None or st.get("request") == request):
            return True
        time.sleep(0.05)
    return False


def cmd_pause(argv: Sequence[str]) -> int:
    """Stop lending now: the node turns DRAINING; running jobs fail over or finish."""
    args = _lending_args(argv, "pause")
    state_dir = _resolve_state_dir(args)
    pid = read_pid(state_dir / "agent.pid")
    if pid is None:
        return _error(f"node-agent is not running (state dir {state_dir}): nothing to pause", 1)
    request = uuid.uuid4().hex
    body = {"id": request, "handoff": args.handoff, "at": time.time()}
    write_private_file(pause_path(state_dir), json.dumps(body) + "\n")
    if not _await_lending(state_dir, paused=True, request=request, timeout=args.timeout):
        return _error(f"the agent (pid {pid}) did not confirm the pause in {args.timeout:.0f}s", 1)
    st = read_json(lending_status_path(state_dir)) or {}
    print(f"node-agent: lending paused (handoff: {st.get('handoff')}); the node is draining")
    return 0


def cmd_resume(argv: Sequence[str]) -> int:
    args = _lending_args(argv, "resume")
    state_dir = _resolve_state_dir(args)
    pid = read_pid(state_dir / "agent.pid")
    if pid is None:
        return _error(f"node-agent is not running (state dir {state_dir}): nothing to resume", 1)
    pause_path(state_dir).unlink(missing_ok=True)
    if not _await_lending(state_dir, paused=False, request=None, timeout=args.timeout):
        st = read_json(lending_status_path(state_dir)) or {}
        return _error(f"still paused: {st.get('reason') or 'the agent did not confirm'}", 1)
    print("node-agent: lending resumed")
    return 0


# --- install-service (agent/service.py) -----------------------------------------------------------


def cmd_install_service(argv: Sequence[str]) -> int:
    parser = Parser("install-service")
    parser.add_argument("--user", action="store_true", help="a user unit (~/.config/systemd/user)")
    parser.add_argument("--no-enable", action="store_true", help="write the unit, do not enable it")
    add_run_arguments(parser)
    parsed = parser.parse(argv)
    user, no_enable = parsed.user, parsed.no_enable
    flags = [a for a in argv if a not in ("--user", "--no-enable")]
    try:
        config = config_from_args(parsed)  # refuse a unit that cannot start
    except ConfigError as exc:
        return _error(str(exc))
    if "--state-dir" not in flags:
        flags += ["--state-dir", str(config.state_dir)]
    path, note = install_service(
        flags=flags, user=user, enable=not no_enable, drain_seconds=config.drain_seconds
    )
    print(f"node-agent: {path} {note}")
    return 0 if "failed" not in note else 1


def cmd_uninstall_service(argv: Sequence[str]) -> int:
    parser = Parser("uninstall-service")
    parser.add_argument("--user", action="store_true", help="the user unit, not the system one")
    path, existed = uninstall_service(user=parser.parse(argv).user)
    print(f"node-agent: {path} {'removed' if existed else 'was not installed'}")
    return 0


# --- doctor --------------------------------------------------------------------------------------


def run_doctor(
    *,
    state_dir: Path,
    controller_url: str | None,
    models_dir: Path,
    hardware_profile: Path | None,
    benchmark: bool,
) -> dict[str, Any]:
    """Detected hardware plus one check per piece. Never raises: a failed check is a result."""
    checks: list[dict[str, Any]] = []
    report: dict[str, Any] = {
        "agent_version": __version__,
        "state_dir": str(state_dir),
        "checks": checks,
    }

    def check(name: str, ok: bool | None, detail: str) -> None:
        # ok=None: skipped (cannot be checked yet, e.g. Redis before enrollment).
        checks.append({"name": name, "ok": ok, "detail": detail})

    try:
        src = hardware_source(models_dir, state_dir, hardware_profile)
        report["hardware"] = src.inventory(benchmark=benchmark)
        check("hardware", True, "detected")
        check("gpu benchmark", *doctor_check(report["hardware"]["gpus"], src.gpu_benchmark_detail))
        # The build's backends and every device llama.cpp lists, with its memory (ggml's API).
        report["llama_devices"] = describe_devices(src.device_scan())
    except Exception as exc:
        check("hardware", False, f"{type(exc).__name__}: {exc}")

    ident = None
    try:
        ident = load_identity(state_dir)
        check(
            "identity",
            True if ident is not None else None,
            f"node {ident.node_id}" if ident else "not enrolled yet (needs --enrollment-token)",
        )
    except IdentityError as exc:
        check("identity", False, str(exc))

    url = controller_url or (ident.controller_url if ident else None)
    if url:
        client = ControllerClient(url, timeout=5.0, max_retries=0)
        try:
            body = client.health()
            check("controller", True, f"{url}/health answered {json.dumps(body)[:120]}")
        except Exception as exc:
            check("controller", False, f"{url}/health: {exc}")
        finally:
            client.close()
    else:
        check("controller", False, "no controller URL (pass --controller-url)")

    if ident is not None:
        try:
            r = redis.Redis.from_url(ident.redis_url, socket_connect_timeout=3, socket_timeout=3)
            r.ping()
            r.close()
            check("redis", True, "PING answered")
        except Exception as exc:
            check("redis", False, f"{type(exc).__name__}: {exc}")
    else:
        check("redis", None, "unknown until enrolled (the controller hands out the URL)")

    ok, detail = llama_rpc_support()
    check("llama.cpp rpc", ok, detail)

    try:
        models = scan_models(models_dir, ShaCache(state_dir))
        report["models"] = models
        check("models", bool(models), f"{len(models)} GGUF file(s) in {models_dir}")
    except Exception as exc:
        check("models", False, f"{type(exc).__name__}: {exc}")
    # No models yet is normal on a fresh node (the controller can send them); not a failure.
    report["ok"] = all(c["ok"] is not False for c in checks if c["name"] != "models")
    return report


def cmd_doctor(argv: Sequence[str]) -> int:
    args = _state_dir_arg(argv, "doctor")
    state_dir = _resolve_state_dir(args)
    models_raw = args.models_dir or os.environ.get("RACON_MODELS_DIR")
    models_dir = Path(models_raw).expanduser() if models_raw else state_dir / "models"
    profile_raw = args.hardware_profile or os.environ.get("RACON_HARDWARE_PROFILE")
    url = args.controller_url or os.environ.get("RACON_CONTROLLER_URL")
    report = run_doctor(
        state_dir=state_dir,
        controller_url=url.rstrip("/") if url else None,
        models_dir=models_dir,
        hardware_profile=Path(profile_raw) if profile_raw else None,
        benchmark=not args.no_benchmark,
    )
    hw = report.get("hardware")
    if hw:
        cpu = hw["cpu"]
        print(
            f"cpu: {cpu.get('model')} ({cpu.get('physical_cores')} cores / {cpu.get('logical_cores')} threads)"
        )
        print(
            f"memory: {hw['memory']['total'] / 2**30:.1f} GiB total, "
            f"{hw['memory']['available'] / 2**30:.1f} GiB available; swap {hw['swap']['total'] / 2**30:.1f} GiB"
        )
        print(f"disk ({hw['disk']['path']}): {hw['disk']['free'] / 2**30:.1f} GiB free")
        for line in report.get("llama_devices") or []:
            print(f"llama.cpp {line}")
        for g in hw["gpus"]:
            print(
                f"gpu {g['index']} ({g.get('device', '?')}): {g['name']} {g['vram_total'] / 2**30:.1f} GiB "
                f"({g['vram_free'] / 2**30:.1f} free), driver {g['driver']}; benchmark "
                + (
                    f"{g['gflops']} GFLOPS, {g['mem_bandwidth_gbps']} GB/s"
                    if "gflops" in g
                    else "none (the controller assumes figures)"
                )
            )
        if not hw["gpus"]:
            print("gpu: none detected")
        if "benchmark" in hw:
            b = hw["benchmark"]
            print(f"benchmark: {b['gflops']} GFLOPS, {b['mem_bandwidth_gbps']} GB/s memory")
    for c in report["checks"]:
        mark = {True: "ok", False: "FAIL", None: "skip"}[c["ok"]]
        print(f"[{mark}] {c['name']}: {c['detail']}")
    if args.bundle:
        path = _write_bundle(Path(args.bundle), state_dir, report)
        print(f"bundle written to {path}")
    return 0 if report["ok"] else 1


def _write_bundle(path: Path, state_dir: Path, report: dict[str, Any]) -> Path:
    """Report + log tails, never the credential: bundles get attached to bug reports.

    Files are scrubbed as they are copied: the stored credential and any URL password are
    replaced, so a secret that slipped into a log line still never leaves the machine.
    """
    secrets: list[str] = []
    try:
        ident = load_identity(state_dir)
        if ident is not None:
            secrets.append(ident.credential)
    except IdentityError:
        pass
    url_password = re.compile(r"(://[^:/@\s]+:)[^@\s]+@")

    def scrub(text: str) -> str:
        for secret in secrets:
            text = text.replace(secret, "[redacted]")
        return url_password.sub(r"\1[redacted]@", text)

    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar, tempfile.TemporaryDirectory() as tmp:
        rp = Path(tmp) / "doctor.json"
        rp.write_text(scrub(json.dumps(report, indent=2, default=str)))
        tar.add(rp, arcname="doctor.json")
        names = ["agent.log", "status.json", "logs/rpc-worker.log"]
        logs = state_dir / "logs"
        if logs.is_dir():
            # The primaries' logs hold llama.cpp's own errors behind failures during execution.
            names += [f"logs/{p.name}" for p in sorted(logs.glob("primary-*.log"))[-5:]]
        for name in names:
            src = state_dir / name
            if src.is_file():
                tail = Path(tmp) / name.replace("/", "_")
                data = src.read_bytes()[-1_000_000:].decode("utf-8", errors="replace")
                tail.write_text(scrub(data))
                tar.add(tail, arcname=name)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-h"], ["--help"], ["help"]):
        sys.stdout.write(top_help())
        return 0
    if args[:1] == ["--version"]:
        print(f"node-agent {__version__}")
        return 0
    if args and not args[0].startswith("-") and args[0] not in SUBCOMMANDS:
        near = closest(args[0], SUBCOMMANDS)
        hint = f"; did you mean {near!r}?" if near else ""
        return _error(f"unknown command {args[0]!r}{hint} (`node-agent --help` lists the commands)")
    if args and args[0] in SUBCOMMANDS:
        sub, rest = args[0], args[1:]
        handler = {
            "run": cmd_run,
            "doctor": cmd_doctor,
            "status": cmd_status,
            "stop": cmd_stop,
            "upgrade": cmd_upgrade,
            "pause": cmd_pause,
            "resume": cmd_resume,
            "install-service": cmd_install_service,
            "uninstall-service": cmd_uninstall_service,
        }[sub]
        return handler(rest)
    return cmd_run(args)


def entrypoint() -> None:
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit: a thread stuck in a C call (llama.cpp, a socket) must not hold the exit hostage
    # after the drain has finished.
    os._exit(code)


if __name__ == "__main__":
    entrypoint()
