"""`make run`: start the whole system in the foreground; Ctrl-C stops every process it started.

Order: secrets (generated once into var/.env.local), embedded Redis when REDIS_URL is unset,
migrations, bootstrap (admin user, enrollment token, default model), daphne, Celery worker and
beat, local node agent(s), then a deployment of the default model.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from racon.embedded import EmbeddedRedis, start_redis

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ("SECRET_KEY", "NODE_ENROLLMENT_SECRET", "AI_API_KEY", "RACON_ADMIN_PASSWORD", "RACON_REDIS_PASSWORD")


def load_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines (no shell syntax); malformed lines are reported, not guessed at."""
    values: dict[str, str] = {}
    if not path.exists():
        return values
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip().isidentifier():
            raise SystemExit(f"error: {path}:{n}: expected KEY=VALUE, got {line!r}")
        values[key.strip()] = value.strip()
    return values


def ensure_secrets(env_file: Path) -> list[str]:
    """Fill missing secrets from the env file, generating (and storing) the ones never made."""
    stored = load_env_file(env_file)
    created: list[str] = []
    for key in GENERATED:
        if os.environ.get(key):
            continue
        if key in stored:
            os.environ[key] = stored[key]
            continue
        value = ("rk_" if key == "AI_API_KEY" else "") + secrets.token_urlsafe(24 if key == "RACON_ADMIN_PASSWORD" else 40)
        os.environ[key] = value
        stored[key] = value
        created.append(key)
    for key, value in stored.items():
        os.environ.setdefault(key, value)
    if created:
        env_file.parent.mkdir(parents=True, exist_ok=True)
        env_file.write_text("".join(f"{k}={v}\n" for k, v in stored.items()))
        env_file.chmod(0o600)
    return created


class Supervisor:
    def __init__(self) -> None:
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.redis: EmbeddedRedis | None = None

    def start(self, name: str, argv: list[str], **kw: object) -> subprocess.Popen[bytes]:
        print(f"[racon] starting {name}: {' '.join(argv[:4])} ...", flush=True)
        proc = subprocess.Popen(argv, cwd=ROOT, start_new_session=True, **kw)  # type: ignore[call-overload]
        self.procs.append((name, proc))
        return proc

    def stop(self) -> None:
        # One at a time in reverse start order, SIGTERM to the main process only: an agent drains
        # (and reports) while the controller is still up, then stops its own llama.cpp children;
        # Celery stops its pool. Whatever is left of a process group after its grace period is killed.
        for name, proc in reversed(self.procs):
            if proc.poll() is None:
                print(f"[racon] stopping {name}", flush=True)
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20 if name.startswith("node-agent") else 10)
                except subprocess.TimeoutExpired:
                    pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.redis is not None:
            print("[racon] stopping embedded Redis", flush=True)
            self.redis.stop()

    def failed(self) -> str | None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                return f"{name} exited with {proc.returncode}"
        return None


def wait_health(url: str, sup: Supervisor, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (why := sup.failed()) is not None:
            raise SystemExit(f"error: {why}")
        try:
            r = httpx.get(f"{url}/health", timeout=2)
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"error: the controller at {url} did not become healthy within {timeout:.0f}s")


def env_defaults(url: str) -> None:
    """The environment `make run` gives its processes unless the operator set it."""
    os.environ.setdefault("RACON_CONTROLLER_URL", url)
    # A controller that others' machines join is never in debug mode unless asked (DEBUG=true):
    # debug pages show settings and tracebacks to anyone.
    os.environ.setdefault("DEBUG", "false")
    os.environ.setdefault("LOG_FORMAT", "text")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="racon-run", description=__doc__)
    parser.add_argument("--agents", type=int, default=int(os.environ.get("RACON_LOCAL_AGENTS", "1")), help="local node agents to start (0 for none)")
    parser.add_argument("--no-deploy", action="store_true", help="do not deploy the default model")
    parser.add_argument("--bind", default=os.environ.get("BIND", "127.0.0.1"), help="daphne bind address (0.0.0.0 to reach it from the LAN)")
    args = parser.parse_args(argv)
    if args.agents < 0:
        parser.error("--agents must be 0 or more")

    var = Path(os.environ.get("RACON_VAR_DIR", ROOT / "var"))
    var.mkdir(parents=True, exist_ok=True)
    created = ensure_secrets(var / ".env.local")
    port = int(os.environ.get("PORT", "8000"))
    url = f"http://127.0.0.1:{port}"
    env_defaults(url)
    py = sys.executable
    bindir = Path(py).parent
    sup = Supervisor()

    def on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        if not os.environ.get("REDIS_URL"):
            # The controller's user needs the password; each node gets a user of its own at
            # enrollment that reaches only its keys (racon/redis_acl.py).
            sup.redis = start_redis(data_dir=var / "redis", password=os.environ["RACON_REDIS_PASSWORD"])
            os.environ["REDIS_URL"] = sup.redis.url
            print(f"[racon] embedded Redis on 127.0.0.1:{sup.redis.port} (password in var/.env.local)", flush=True)
        subprocess.run([py, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, check=True)
        boot = subprocess.run(
            [py, "manage.py", "racon_bootstrap", "--agents", str(max(1, args.agents))], cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True
        )
        info = json.loads(boot.stdout.strip().splitlines()[-1])
        if created:
            print("\n[racon] generated secrets (stored in var/.env.local, shown once):", flush=True)
            for key in created:
                print(f"  {key}={os.environ[key]}", flush=True)
            print("", flush=True)
        processes = int(os.environ.get("DAPHNE_PROCESSES") or min(2, os.cpu_count() or 1))
        access_log = os.environ.get("RACON_ACCESS_LOG") or None
        # Several daphne processes accept on one socket (racon/serve.py); on this project's 2-core
        # machines two sustain 1.4-1.7x the heartbeats of one (bench/heartbeats.py, side by side).
        from racon.serve import bind_listener, daphne_argv

        listener = bind_listener(args.bind, port)
        for i in range(max(1, processes)):
            name = "daphne" if processes <= 1 else f"daphne-{i + 1}"
            sup.start(name, daphne_argv(listener.fileno(), access_log), pass_fds=(listener.fileno(),))
        sup.start("celery-worker", [str(bindir / "celery"), "-A", "racon", "worker", "-l", "warning", "--concurrency", "4", "-n", "racon@%h"])
        sup.start("celery-beat", [str(bindir / "celery"), "-A", "racon", "beat", "-l", "warning", "-s", str(var / "celerybeat-schedule")])
        wait_health(url, sup)
        models_dir = Path(os.environ.get("RACON_MODELS_DIR", var / "agent-models"))
        for i in range(args.agents):
            name = f"local-{i + 1}"
            sup.start(
                f"node-agent {name}",
                [
                    str(bindir / "node-agent"), "--foreground", "--controller-url", url, "--enrollment-token", info["token"],
                    "--node-name", name, "--state-dir", str(var / "agents" / name), "--models-dir", str(models_dir),
                    "--advertise-address", "127.0.0.1", "--rpc-port", str(50052 + i),
                ],
            )
        if args.agents and info.get("model") and not args.no_deploy:
            deploy_default(url, info["model"], sup)
        print(f"\n[racon] ready: {url}  (web UI: log in as admin; API key: AI_API_KEY in var/.env.local)", flush=True)
        print(f"[racon] try: curl {url}/v1/chat/completions -H 'Authorization: Bearer $AI_API_KEY' "
              f"-H 'Content-Type: application/json' -d '{{\"model\": \"{info.get('model')}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hi\"}}]}}'", flush=True)
        while True:
            if (why := sup.failed()) is not None:
                print(f"[racon] {why}; stopping everything", flush=True)
                return 1
            time.sleep(1)
    except KeyboardInterrupt:
        print("\n[racon] shutting down", flush=True)
        return 0
    finally:
        sup.stop()


def deploy_default(url: str, model: str, sup: Supervisor) -> None:
    """Wait for a READY local node, then deploy the default model (placement runs in Celery)."""
    headers = {"Authorization": f"Bearer {os.environ['AI_API_KEY']}"}
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if (why := sup.failed()) is not None:
            raise SystemExit(f"error: {why}")
        try:
            nodes = httpx.get(f"{url}/api/admin/nodes?state=READY", headers=headers, timeout=5).json()
            if nodes:
                break
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(1)
    else:
        print("[racon] no node became READY within 180 s; not deploying", flush=True)
        return
    active = httpx.get(f"{url}/api/admin/deployments?model={model}", headers=headers, timeout=10).json()
    if any(d["state"] in ("PLANNING", "LOADING", "READY", "DEGRADED") for d in active):
        print(f"[racon] {model} is already deployed", flush=True)
        return
    # A first request may have deployed it meanwhile (deployment_ensure); the scheduler then
    # refuses a second replica on the same node, which is no failure of make run.
    resp = httpx.post(f"{url}/api/admin/deployments", headers=headers, json={"model": model}, timeout=30)
    if resp.status_code >= 400:
        active = httpx.get(f"{url}/api/admin/deployments?model={model}", headers=headers, timeout=10).json()
        if any(d["state"] in ("PLANNING", "LOADING", "READY", "DEGRADED") for d in active):
            print(f"[racon] {model} is already deployed", flush=True)
        else:
            print(f"[racon] could not deploy {model}: {resp.text}", flush=True)
        return
    print(f"[racon] deploying {model} (deployment {resp.json()['id']})", flush=True)


if __name__ == "__main__":
    shutil.which("daphne")
    sys.exit(main())
