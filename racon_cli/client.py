"""A thin client of the controller's REST API. Every failure becomes one ``ApiError`` line."""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
from httpx_sse import connect_sse

# A CLI prints its own one-line results and errors, never a library's per-request log lines.
logging.getLogger("httpx").setLevel(logging.WARNING)
logging.getLogger("httpcore").setLevel(logging.WARNING)

UUID_RE = re.compile(
    r"^[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}$"
)

# Exit codes scripts can rely on.
EXIT_API = 1  # the controller answered with an error (4xx/5xx)
EXIT_UNREACHABLE = 3  # no answer at all
EXIT_CONFIG = 4  # no URL or key configured, or a local file problem

_STATUS_WORDS = {
    400: "bad request",
    401: "unauthorized",
    403: "forbidden",
    404: "not found",
    409: "conflict",
    422: "refused",
    429: "too many requests",
    500: "server error",
    502: "bad gateway",
    503: "unavailable",
}


class ApiError(Exception):
    """One clear line for the user, and the exit code that goes with it."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        exit_code: int = EXIT_API,
        body: Any = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.exit_code = exit_code
        self.body = body


def is_uuid(value: str) -> bool:
    return bool(UUID_RE.match(value))


def error_message(resp: httpx.Response) -> tuple[str, Any]:
    """The controller's own reason, from either error format (admin API or OpenAI's)."""
    try:
        body = resp.json()
    except ValueError:
        return "", None
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        message = str(err.get("message") or err.get("reason") or "")
        fields = err.get("fields")
        if isinstance(fields, dict) and fields:
            parts = []
            for name, problems in fields.items():
                text = (
                    "; ".join(str(p) for p in problems)
                    if isinstance(problems, list)
                    else str(problems)
                )
                parts.append(text if name == "non_field_errors" else f"{name}: {text}")
            message = f"{message}: {', '.join(parts)}" if message else ", ".join(parts)
        return message, body
    if isinstance(body, dict) and "detail" in body:
        return str(body["detail"]), body
    return "", body


def raise_for(resp: httpx.Response, *, what: str = "") -> None:
    if resp.status_code < 400:
        return
    reason, body = error_message(resp)
    word = _STATUS_WORDS.get(resp.status_code, resp.reason_phrase.lower() or "error")
    hint = ""
    if resp.status_code == 401:
        hint = " (check the key: `racon login`, --key or RACON_API_KEY)"
        reason = reason or "missing or invalid API key"
    elif resp.status_code == 403:
        reason = reason or "this key may not do that"
    elif resp.status_code == 404 and not reason:
        reason = f"{what or resp.request.url.path} does not exist on this controller"
    raise ApiError(
        f"{resp.status_code} {word}: {reason or resp.text[:200].strip() or 'no details'}{hint}",
        status=resp.status_code,
        body=body,
    )


class Client:
    """Sync HTTP with short connect timeouts; streaming helpers for SSE."""

    def __init__(
        self,
        url: str,
        key: str,
        *,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        if not url:
            raise ApiError(
                "no controller URL: run `racon login --url URL --key KEY` or set RACON_URL",
                exit_code=EXIT_CONFIG,
            )
        if not url.startswith(("http://", "https://")):
            raise ApiError(
                f"controller URL must start with http:// or https://, got {url!r}",
                exit_code=EXIT_CONFIG,
            )
        self.url = url.rstrip("/")
        headers = {"Accept": "application/json", "User-Agent": "racon-cli"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self.http = httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=5.0),
            transport=transport,
        )

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- plumbing ---------------------------------------------------------------------------------

    def request(
        self, method: str, path: str, *, what: str = "", timeout: float | None = None, **kw: Any
    ) -> httpx.Response:
        try:
            resp = self.http.request(
                method,
                path,
                timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
                **kw,
            )
        except httpx.ConnectError as exc:
            raise ApiError(
                f"cannot reach the controller at {self.url}: {_short(exc)}",
                exit_code=EXIT_UNREACHABLE,
            ) from None
        except httpx.TimeoutException:
            raise ApiError(
                f"the controller at {self.url} did not answer in time", exit_code=EXIT_UNREACHABLE
            ) from None
        except httpx.HTTPError as exc:
            raise ApiError(
                f"request to {self.url} failed: {_short(exc)}", exit_code=EXIT_UNREACHABLE
            ) from None
        raise_for(resp, what=what)
        return resp

    def get(self, path: str, **kw: Any) -> Any:
        return self.request("GET", path, **kw).json()

    def post(self, path: str, body: Any = None, **kw: Any) -> Any:
        resp = self.request("POST", path, json=body if body is not None else {}, **kw)
        return resp.json() if resp.content else {}

    # --- names → ids ------------------------------------------------------------------------------

    def node(self, ref: str) -> dict[str, Any]:
        """A node by id or exact name (404 with the name when there is none)."""
        if is_uuid(ref):
            path = f"/api/admin/nodes/{uuid.UUID(ref)}"
        else:
            matches = [
                n for n in self.get("/api/admin/nodes", params={"name": ref}) if n["name"] == ref
            ]
            if not matches:
                raise ApiError(f"404 not found: no node named {ref!r}", status=404)
            if len(matches) > 1:
                ids = ", ".join(m["id"][:8] for m in matches)
                raise ApiError(
                    f"{len(matches)} nodes are named {ref!r} ({ids}); use the id", status=409
                )
            path = f"/api/admin/nodes/{matches[0]['id']}"
        node: dict[str, Any] = self.get(path, what=f"node {ref}")
        return node

    def by_prefix(self, items: list[dict[str, Any]], ref: str, kind: str) -> dict[str, Any]:
        """An item of a listing by full id or a unique id prefix (what the tables show)."""
        ref_l = ref.lower()
        found = [i for i in items if str(i["id"]).lower() == ref_l] or [
            i for i in items if str(i["id"]).lower().startswith(ref_l)
        ]
        if not found:
            raise ApiError(f"404 not found: no {kind} {ref!r}", status=404)
        if len(found) > 1:
            raise ApiError(
                f"{kind} id prefix {ref!r} is ambiguous ({len(found)} match); give more characters",
                status=409,
            )
        return found[0]

    def by_ref(
        self, items: list[dict[str, Any]], ref: str, kind: str, names: tuple[str, ...] = ("name",)
    ) -> dict[str, Any]:
        """An item by its name (the `names` fields, case-insensitive, e.g. an account's name or
        username, a token's label), else by full id or a unique id prefix."""
        ref_l = ref.lower()
        named = [i for i in items if any(str(i.get(n) or "").lower() == ref_l for n in names)]
        if len(named) == 1:
            return named[0]
        if len(named) > 1:
            raise ApiError(
                f"{len(named)} {kind}s are named {ref!r}; give the id (or a unique id prefix)",
                status=409,
            )
        return self.by_prefix(items, ref, kind)

    def account_id(self, ref: str) -> str:
        """An account's id from its name, its username, its id or a unique id prefix."""
        try:
            return str(uuid.UUID(ref))  # a full id needs no listing (which only operators see)
        except ValueError:
            pass
        accounts = self.get("/api/admin/accounts")
        return str(self.by_ref(accounts, ref, "account", ("name", "username"))["id"])

    # --- streaming --------------------------------------------------------------------------------

    def stream_chat(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """POST /v1/chat/completions with stream: true; yields each SSE data object."""
        try:
            with connect_sse(
                self.http,
                "POST",
                "/v1/chat/completions",
                json={**body, "stream": True},
                timeout=httpx.Timeout(300.0, connect=5.0),
            ) as events:
                resp = events.response
                if resp.status_code >= 400:
                    resp.read()
                    raise_for(resp)
                yield {"_headers": dict(resp.headers)}
                # iter_sse refuses a body that is not text/event-stream (SSEError, an httpx error).
                for event in events.iter_sse():
                    if event.data == "[DONE]":
                        return
                    chunk = json.loads(event.data)
                    if isinstance(chunk, dict) and chunk.get("error"):
                        err = chunk["error"]
                        raise ApiError(
                            f"stream error: {err.get('message') if isinstance(err, dict) else err}"
                        )
                    yield chunk
        except httpx.ConnectError as exc:
            raise ApiError(
                f"cannot reach the controller at {self.url}: {_short(exc)}",
                exit_code=EXIT_UNREACHABLE,
            ) from None
        except httpx.TimeoutException:
            raise ApiError(
                f"the controller at {self.url} stopped answering mid-stream",
                exit_code=EXIT_UNREACHABLE,
            ) from None
        except httpx.HTTPError as exc:
            raise ApiError(
                f"stream from {self.url} failed: {_short(exc)}", exit_code=EXIT_UNREACHABLE
            ) from None


def _short(exc: Exception) -> str:
    text = str(exc) or exc.__class__.__name__
    # httpx wraps OS errors as "[Errno 111] Connection refused"; keep the readable part.
    m = re.search(r"\[Errno -?\d+\] (.+)$", text)
    return (m.group(1) if m else text).strip().rstrip(".").lower()
