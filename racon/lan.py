"""`BIND=<address> make run`: which address serves the LAN, and which Redis set-ups are unsafe there.

Pure functions (no Django), shared by the launcher, the controller's start-up check and tests.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

import psutil
import redis

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")
ANY = ("0.0.0.0", "::", "[::]")


class BindError(ValueError):
    """BIND names an address this machine cannot serve the LAN on; one line for the operator."""


def machine_addresses() -> list[str]:
    """Every IP address of this machine's interfaces (IPv4 first)."""
    out: list[str] = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                ip = a.address.split("%", 1)[0]
                if ip not in out:
                    out.append(ip)
    return sorted(out, key=lambda ip: (":" in ip, ip))


def is_loopback_host(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _lan_candidate(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    return addr.is_private and not (addr.is_loopback or addr.is_link_local or addr.is_multicast)


def resolve_bind(bind: str, addresses: list[str] | None = None) -> tuple[str | None, str]:
    """(the LAN address to serve, a line saying so), or (None, "") for a loopback-only run.

    0.0.0.0 (or ::) picks this machine's private LAN address. An address the machine does not
    have, or a public one, raises BindError naming why."""
    bind = bind.strip()
    if not bind or is_loopback_host(bind):
        return None, ""
    addresses = machine_addresses() if addresses is None else addresses
    if bind in ANY:
        private = [ip for ip in addresses if ":" not in ip and _lan_candidate(ip)]
        if not private:
            raise BindError(
                f"BIND={bind}: this machine has no private LAN address (its addresses: "
                f"{', '.join(addresses) or 'none'}); name one with BIND=<address>"
            )
        return private[0], (
            f"BIND={bind} serves the LAN on {private[0]}, this machine's private address"
            + (
                f" (others: {', '.join(private[1:])}; BIND=<address> picks one)"
                if private[1:]
                else ""
            )
        )
    try:
        addr = ipaddress.ip_address(bind.strip("[]"))
    except ValueError:
        raise BindError(
            f"BIND={bind} is not an IP address; this machine's addresses: {', '.join(addresses)}"
        ) from None
    ip = str(addr)
    if ip not in addresses:
        raise BindError(
            f"BIND={bind} is not an address of this machine; its addresses: {', '.join(addresses)}"
        )
    if not _lan_candidate(ip):
        why = "link-local" if addr.is_link_local else "public"
        raise BindError(
            f"BIND={bind} is a {why} address: the compute plane (Redis, ggml-rpc, llama-server) "
            "stays on private networks (10/8, 172.16/12, 192.168/16, fc00::/7); put a reverse "
            'proxy in front for the public side (README "TLS behind a reverse proxy")'
        )
    return ip, f"BIND={bind}: serving the LAN on {ip}"


def redis_url_problem(url: str, *, name: str, ca_file: str | None = None) -> str | None:
    """Why the Redis at `url` must not be used by a controller whose nodes are on the LAN, or
    None. A loopback Redis (CI's 127.0.0.1:6379) is left alone; a non-loopback one must be TLS
    (rediss://) and must not let its `default` user in without a password. `ca_file` verifies a
    Redis whose certificate the controller's own CA issued. A URL without credentials (the one
    nodes get, each with its own user) that the server answers with NOAUTH is safe: its
    `default` user needs a password or is off."""
    parts = urlsplit(url)
    if parts.scheme == "unix" or is_loopback_host(parts.hostname or "127.0.0.1"):
        return None
    if parts.scheme != "rediss":
        return (
            f"{name} {redact(url)} is a Redis on a non-loopback address without TLS: prompts, "
            "answers and node passwords would cross the LAN in plaintext. Use rediss:// with "
            'Redis\'s tls-port (README "An external Redis"), or leave REDIS_URL unset and '
            "`BIND=<address> make run` starts one"
        )
    try:
        client = redis.Redis.from_url(
            url, socket_timeout=5, socket_connect_timeout=5, ssl_ca_certs=ca_file
        )
        try:
            info = client.execute_command("ACL", "GETUSER", "default")
        finally:
            client.close()
    except redis.AuthenticationError:
        if parts.username or parts.password:
            return f"{name} {redact(url)}: its user and password were refused"
        return None  # no credentials given, and the server asks for them: default is not open
    except redis.RedisError as exc:
        return f"{name} {redact(url)}: cannot check its `default` user ({exc})"
    flags = _acl_field(info, "flags")
    if flags is not None and b"nopass" in flags and b"off" not in flags:
        return (
            f"{name} {redact(url)}: its `default` user needs no password (ACL GETUSER default "
            "shows nopass), so any host that reaches it can read every node's queue. Set "
            '`requirepass`, or `user default off` in an ACL file (README "An external Redis")'
        )
    return None


def _acl_field(info: object, key: str) -> list[bytes] | None:
    if not isinstance(info, list | tuple):
        return None
    items = list(info)
    for k, v in zip(items[::2], items[1::2], strict=False):
        if (k.decode() if isinstance(k, bytes) else k) == key and isinstance(v, list | tuple):
            return [x if isinstance(x, bytes) else str(x).encode() for x in v]
    return None


def redact(url: str) -> str:
    if "@" in url:
        scheme, _, rest = url.partition("://")
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


def controller_redis_refusal(
    urls: dict[str, str], *, insecure_lan: bool, ca_file: str | None = None
) -> str | None:
    """Why the controller must not start with these Redis URLs (REDIS_URL, RACON_AGENT_REDIS_URL,
    CELERY_BROKER_URL), or None: the check the launcher makes, made by every controller process
    too, so a controller started without the launcher refuses the same set-ups. RACON_INSECURE_LAN=1
    (a trusted LAN, plain http) accepts them."""
    if insecure_lan:
        return None
    problems = [
        problem
        for name, url in urls.items()
        if url and (problem := redis_url_problem(url, name=name, ca_file=ca_file))
    ]
    if not problems:
        return None
    return "; ".join(problems) + " (or RACON_INSECURE_LAN=1 for a trusted LAN)"
