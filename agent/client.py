"""Controller HTTP client: timeouts, bounded retries with capped backoff, one log line per change.

Only the transport lives here; what to send and when is the Agent's business.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import certifi
import httpx

from agent import __version__
from agent.protocol import (
    PROTOCOL_PATH,
    EnrollRequest,
    EnrollResponse,
    Heartbeat,
    HeartbeatResponse,
    ProtocolInfo,
    Report,
)
from agent.retry import RetryStopped, retry_call

log = logging.getLogger("agent.client")


CA_FILE_NAME = "controller-ca.pem"
BUNDLE_FILE_NAME = "ca-bundle.pem"
REPIN_HINT = (
    "the controller's certificate does not verify against the CA this agent keeps ({detail}). "
    "If the controller's CA was renewed or rotated, re-pin: run a new join line from the "
    "controller (`racon tokens create <name>`) on this machine; it keeps the node and hands "
    "this agent the new CA"
)


def controller_ca(state_dir: Path, given: Path | None) -> Path | None:
    """The controller's CA this agent checks every https and rediss connection against.

    `given` (--ca-file, RACON_CA_FILE: the join line and `make run` pass it) is copied into the
    state dir, where a restarted agent finds it without being told again."""
    kept = state_dir / CA_FILE_NAME
    if given is not None:
        data = given.read_bytes()
        if not kept.is_file() or kept.read_bytes() != data:
            state_dir.mkdir(parents=True, exist_ok=True)
            tmp = kept.with_name(f".{kept.name}.{os.getpid()}")
            tmp.write_bytes(data)
            os.replace(tmp, kept)
        return kept
    return kept if kept.is_file() else None


def trust_controller_ca(ca: Path | None, state_dir: Path) -> None:
    """Process-wide: every TLS client of this process (httpx's model and KV downloads, redis-py,
    urllib) trusts the system's CAs plus the controller's (SSL_CERT_FILE, a bundle in the state
    dir). The controller's own client and Redis link also pass the CA explicitly."""
    if ca is None:
        return
    try:
        system = Path(certifi.where()).read_bytes()
    except OSError:
        system = b""
    bundle = state_dir / BUNDLE_FILE_NAME
    bundle.write_bytes(system + b"\n" + ca.read_bytes())
    os.environ["SSL_CERT_FILE"] = str(bundle)


def tls_verify(ca_file: Path | None) -> ssl.SSLContext | bool:
    return ssl.create_default_context(cafile=str(ca_file)) if ca_file is not None else True


class ControllerError(Exception):
    """The controller answered, and the answer was a final refusal (4xx)."""

    def __init__(self, message: str, *, status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class NodeRevoked(ControllerError):
    """The controller revoked this node's credential. The agent must stop."""


class Unauthorized(ControllerError):
    """The credential or enrollment token was refused (not revoked: unknown, expired, wrong)."""


class ProtocolUnsupported(ControllerError):
    """The controller refused this agent's node protocol version (HTTP 409 protocol_unsupported).
    Final: only another agent version can talk to it."""


class ControllerUnavailable(Exception):
    """The controller could not be reached, or kept answering 5xx, through every retry."""


class _Retryable(Exception):
    """A transport error, 429 or 5xx: worth another try."""


class ControllerClient:
    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 10.0,
        max_retries: int = 4,
        backoff_base: float = 0.5,
        backoff_cap: float = 30.0,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
        ca_file: Path | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.max_retries = max_retries
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap
        self._sleep = sleep
        self._auth: str | None = None
        # httpx.Client is thread-safe; the heartbeat thread and the report sender share it.
        self._http = httpx.Client(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)),
            transport=transport,
            verify=tls_verify(ca_file),
            headers={"User-Agent": f"racon-node-agent/{__version__}"},
        )
        self._state_lock = threading.Lock()
        self._reachable: bool | None = None  # None until the first answer or failure

    def close(self) -> None:
        self._http.close()

    def set_credentials(self, node_id: str, credential: str) -> None:
        self._auth = f"Node {node_id}:{credential}"

    @property
    def reachable(self) -> bool | None:
        return self._reachable

    # --- state-change logging ---------------------------------------------------------------

    def _mark(self, ok: bool, detail: str = "") -> None:
        with self._state_lock:
            before = self._reachable
            self._reachable = ok
        if before is ok:
            return
        if ok:
            if before is False:
                log.info("controller %s is reachable again", self.base_url)
        elif "CERTIFICATE_VERIFY_FAILED" in detail:
            log.error("controller %s: %s", self.base_url, REPIN_HINT.format(detail=detail))
        else:
            log.warning(
                "controller %s unreachable (%s); retrying with backoff up to %.0fs",
                self.base_url,
                detail,
                self.backoff_cap,
            )

    # --- requests -----------------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        auth: bool = True,
        retries: int | None = None,
        stop: threading.Event | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """Send one request; retry transport errors, 429 and 5xx. Returns the decoded JSON body.

        Raises NodeRevoked / Unauthorized / ControllerError on final refusals and
        ControllerUnavailable once the retries are spent (or `stop` is set while waiting).
        """
        retries = self.max_retries if retries is None else retries
        headers = dict(headers or {})
        if auth and self._auth:
            headers["Authorization"] = self._auth
        last = ""

        def attempt() -> Any:
            nonlocal last
            try:
                resp = self._http.request(method, path, json=json, headers=headers)
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            else:
                if resp.status_code < 500 and resp.status_code != 429:
                    self._mark(True)
                    return self._decode(resp, method, path)
                last = f"HTTP {resp.status_code}"
            self._mark(False, last)
            raise _Retryable(last)

        def on_retry(_: BaseException, failures: int, delay: float) -> None:
            log.debug("retry %d of %s %s in %.2fs (%s)", failures, method, path, delay, last)

        try:
            return retry_call(
                attempt,
                retry_on=_Retryable,
                base=self.backoff_base,
                cap=self.backoff_cap,
                attempts=retries + 1,
                stop=stop,
                sleep=self._sleep,
                on_retry=on_retry,
            )
        except _Retryable:
            raise ControllerUnavailable(f"{method} {path}: {last}") from None
        except RetryStopped:
            raise ControllerUnavailable(f"{method} {path}: {last} (stopping)") from None

    @staticmethod
    def _decode(resp: httpx.Response, method: str, path: str) -> Any:
        body = resp.text
        if resp.status_code in (401, 403):
            message = _error_message(resp) or body[:200]
            if _error_code(resp) == "node_revoked":
                raise NodeRevoked(
                    f"node credential revoked by the controller: {message}",
                    status=resp.status_code,
                    body=body,
                )
            raise Unauthorized(
                f"{method} {path} refused (HTTP {resp.status_code}): {message}",
                status=resp.status_code,
                body=body,
            )
        if resp.status_code >= 400:
            message = _error_message(resp) or body[:200]
            if resp.status_code == 409 and _error_code(resp) == "protocol_unsupported":
                raise ProtocolUnsupported(message, status=resp.status_code, body=body)
            raise ControllerError(
                f"{method} {path} failed (HTTP {resp.status_code}): {message}",
                status=resp.status_code,
                body=body,
            )
        if not body:
            return {}
        try:
            return resp.json()
        except ValueError:
            raise ControllerError(
                f"{method} {path}: controller answered non-JSON", status=resp.status_code
            ) from None

    # --- endpoints ----------------------------------------------------------------------------

    def health(self, *, retries: int = 0) -> dict[str, Any]:
        return cast(dict[str, Any], self.request("GET", "/health", auth=False, retries=retries))

    def protocol(
        self, *, retries: int | None = None, stop: threading.Event | None = None
    ) -> ProtocolInfo:
        """The controller's node protocol (no auth, nothing changes): read before enrolling."""
        body = self.request("GET", PROTOCOL_PATH, auth=False, retries=retries, stop=stop)
        version = body.get("protocol_version") if isinstance(body, dict) else None
        if not isinstance(version, int) or isinstance(version, bool):
            raise ControllerError(
                f"GET {PROTOCOL_PATH}: no integer 'protocol_version' in the answer"
            )
        return cast(ProtocolInfo, body)

    def enroll(
        self,
        req: EnrollRequest,
        *,
        retries: int | None = None,
        stop: threading.Event | None = None,
        presented: tuple[str, str] | None = None,
    ) -> EnrollResponse:
        """Enroll with a token. `presented`: a stored (node_id, credential), which the controller
        requires before it lets this machine re-enroll as the node it already is."""
        body = self.request(
            "POST",
            "/api/agent/enroll",
            json=req,
            auth=False,
            retries=retries,
            stop=stop,
            headers={"Authorization": f"Node {presented[0]}:{presented[1]}"} if presented else None,
        )
        for key in ("node_id", "credential", "redis_url"):
            if key not in body:
                raise ControllerError(f"enroll response lacks {key!r}")
        return cast(EnrollResponse, body)

    def heartbeat(self, hb: Heartbeat, *, retries: int = 0) -> HeartbeatResponse:
        # No retries by default: the next beat is the retry, and a stale beat is worthless.
        return cast(
            HeartbeatResponse,
            self.request("POST", "/api/agent/heartbeat", json=hb, retries=retries),
        )

    def redis_url(self) -> str:
        """The node's Redis URL as the controller has it now (POST /api/agent/redis): granted
        again, for when the one from enrollment went stale (the controller's Redis restarted)."""
        body = self.request("POST", "/api/agent/redis", retries=0)
        url = body.get("redis_url") if isinstance(body, dict) else None
        if not isinstance(url, str) or not url:
            raise ControllerError("redis response lacks 'redis_url'")
        return url

    def report(
        self, report: Report, *, retries: int | None = None, stop: threading.Event | None = None
    ) -> dict[str, Any]:
        return cast(
            dict[str, Any],
            self.request("POST", "/api/agent/reports", json=report, retries=retries, stop=stop),
        )

    def download(self) -> httpx.Client:
        """The underlying client, for streamed downloads that carry the node's auth."""
        return self._http

    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": self._auth} if self._auth else {}


def _error_message(resp: httpx.Response) -> str:
    try:
        data = resp.json()
    except ValueError:
        return ""
    if isinstance(data, dict):
        err = data.get("error", data.get("detail", ""))
        if isinstance(err, dict):
            return str(err.get("message", err))
        return str(err)
    return ""


def _error_code(resp: httpx.Response) -> str:
    try:
        data = resp.json()
    except ValueError:
        return ""
    err = data.get("error") if isinstance(data, dict) else None
    return str(err.get("code", "")) if isinstance(err, dict) else ""
