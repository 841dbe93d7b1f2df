"""The owner's lending terms: idle-only, time windows, caps, and the handoff on a pause.

Pure where it can be: the policy is a frozen dataclass with a wire form (``to_wire`` /
``policy_from_wire``) that the controller reads too (it imports this module, which imports no
Django), and ``lending_open`` takes the clock and the idle source as arguments so tests never
sleep. A policy file is TOML or JSON::

    timezone = "Europe/Paris"
    windows = ["mon-fri 19:00-08:00", "sat,sun 00:00-24:00"]
    handoff = "failover"          # or "finish": what a pause does to running jobs
    [idle]
    minutes = 10                  # no keyboard/mouse input for this long
    cpu_below = 25                # other processes' CPU load below this percent
    [caps]
    ram_gb = 16
    vram_gb = 8
    threads = 4

Every error names the field it is about (``PolicyError``); the agent does not start with a policy
it cannot honour.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Protocol
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from agent.identity import write_private_file

GiB = 1 << 30
HANDOFFS = ("failover", "finish")
DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_WINDOW_RE = re.compile(
    r"^(?:(?P<days>[a-z,\-]+)\s+)?(?P<start>\d{1,2}:\d{2})\s*-\s*(?P<end>\d{1,2}:\d{2})$"
)


class PolicyError(ValueError):
    """A lending policy value is wrong. The message names the field and is meant for the owner."""

    @property
    def field(self) -> str:
        """The field the message names (its text before the first colon): ``caps.ram_gb``,
        ``windows[1]``, ``timezone``; a form maps it back to its input."""
        return str(self).split(":", 1)[0].strip()


@dataclass(frozen=True)
class Window:
    """Days of the week (0 = Monday) on which lending opens at ``start`` for ``minutes``.

    A window whose end is before its start runs past midnight (19:00-08:00 opens on the listed
    days at 19:00 and closes at 08:00 the next morning).
    """

    text: str
    days: frozenset[int]
    start: int  # minutes after midnight
    minutes: int  # length, 1..1440


def parse_window(text: str, *, field_name: str = "windows") -> Window:
    raw = " ".join(str(text).strip().lower().split())
    m = _WINDOW_RE.match(raw)
    if not m:
        raise PolicyError(
            f"{field_name}: {text!r} is not a window like 'mon-fri 19:00-08:00' or '09:00-17:00'"
        )
    days = _parse_days(m.group("days") or "mon-sun", text=text, field_name=field_name)
    start = _minutes(m.group("start"), text=text, field_name=field_name, allow_24=False)
    end = _minutes(m.group("end"), text=text, field_name=field_name, allow_24=True)
    if end == start:
        raise PolicyError(f"{field_name}: {text!r} starts and ends at the same time")
    length = (end - start) % 1440 or 1440  # 00:00-24:00 is the whole day
    return Window(text=raw, days=frozenset(days), start=start, minutes=length)


def _parse_days(spec: str, *, text: str, field_name: str) -> set[int]:
    if spec in ("daily", "every", "all"):
        return set(range(7))
    if spec in ("weekdays",):
        return set(range(5))
    if spec in ("weekends", "weekend"):
        return {5, 6}
    out: set[int] = set()
    for part in spec.split(","):
        a, _, b = part.partition("-")
        if a not in DAYS or (b and b not in DAYS):
            raise PolicyError(
                f"{field_name}: {text!r} has an unknown day {part!r} (use mon..sun, weekdays)"
            )
        i, j = DAYS.index(a), DAYS.index(b or a)
        out.update((i + k) % 7 for k in range((j - i) % 7 + 1))
    return out


def _minutes(hhmm: str, *, text: str, field_name: str, allow_24: bool) -> int:
    h, m = (int(x) for x in hhmm.split(":"))
    if (h == 24 and m == 0 and allow_24) or (0 <= h < 24 and 0 <= m < 60):
        return h * 60 + m
    raise PolicyError(f"{field_name}: {text!r} has an invalid time {hhmm!r}")


@dataclass(frozen=True)
class Caps:
    ram_bytes: int | None = None
    vram_bytes: int | None = None
    threads: int | None = None


@dataclass(frozen=True)
class LendingPolicy:
    timezone: str = "UTC"
    windows: tuple[Window, ...] = ()  # empty: always
    idle_minutes: float | None = None
    cpu_below: float | None = None
    caps: Caps = field(default_factory=Caps)
    handoff: str = "failover"

    @property
    def zone(self) -> ZoneInfo:
        return ZoneInfo(self.timezone)

    @property
    def is_default(self) -> bool:
        return self == LendingPolicy()

    def to_wire(self) -> dict[str, Any]:
        return {
            "timezone": self.timezone,
            "windows": [w.text for w in self.windows],
            "idle_minutes": self.idle_minutes,
            "cpu_below": self.cpu_below,
            "caps": {
                "ram_bytes": self.caps.ram_bytes,
                "vram_bytes": self.caps.vram_bytes,
                "threads": self.caps.threads,
            },
            "handoff": self.handoff,
        }


def _positive(
    value: Any, field_name: str, *, integer: bool = False, most: float | None = None
) -> Any:
    if value is None or value == "":
        return None
    try:
        num = int(value) if integer and float(value).is_integer() else float(value)
    except (TypeError, ValueError):
        raise PolicyError(f"{field_name}: must be a number, got {value!r}") from None
    if integer and not isinstance(num, int):
        raise PolicyError(f"{field_name}: must be a whole number, got {value!r}")
    if num <= 0 or (most is not None and num > most):
        bound = f" and at most {most:g}" if most is not None else ""
        raise PolicyError(f"{field_name}: must be above 0{bound}, got {value!r}")
    return num


def _zone(name: Any) -> str:
    try:
        ZoneInfo(str(name))
    except (ZoneInfoNotFoundError, ValueError):
        raise PolicyError(
            f"timezone: unknown time zone {name!r} (use e.g. 'Europe/Paris')"
        ) from None
    return str(name)


def policy_from_wire(data: Mapping[str, Any]) -> LendingPolicy:
    """The wire form (to_wire) back into a policy, validated. Raises PolicyError."""
    if not isinstance(data, Mapping):
        raise PolicyError("lending: must be an object")
    windows = data.get("windows") or []
    if isinstance(windows, str):
        windows = [windows]
    if not isinstance(windows, list):
        raise PolicyError("windows: must be a list of strings like 'mon-fri 19:00-08:00'")
    caps = data.get("caps") or {}
    if not isinstance(caps, Mapping):
        raise PolicyError("caps: must be an object")
    handoff = str(data.get("handoff") or "failover")
    if handoff not in HANDOFFS:
        raise PolicyError(f"handoff: must be failover or finish, got {handoff!r}")
    return LendingPolicy(
        timezone=_zone(data.get("timezone") or "UTC"),
        windows=tuple(parse_window(w, field_name=f"windows[{i}]") for i, w in enumerate(windows)),
        idle_minutes=_positive(data.get("idle_minutes"), "idle.minutes", most=7 * 24 * 60),
        cpu_below=_positive(data.get("cpu_below"), "idle.cpu_below", most=100),
        caps=Caps(
            ram_bytes=_positive(caps.get("ram_bytes"), "caps.ram_gb", integer=True),
            vram_bytes=_positive(caps.get("vram_bytes"), "caps.vram_gb", integer=True),
            threads=_positive(caps.get("threads"), "caps.threads", integer=True),
        ),
        handoff=handoff,
    )


def _gib(value: Any, field_name: str) -> int | None:
    num = _positive(value, field_name)
    return None if num is None else int(float(num) * GiB)


def policy_from_document(doc: Mapping[str, Any]) -> LendingPolicy:
    """A policy file's document (TOML or JSON: sizes in GB) into a policy. Raises PolicyError."""
    known = {"timezone", "windows", "handoff", "idle", "caps"}
    unknown = sorted(set(doc) - known)
    if unknown:
        raise PolicyError(f"{unknown[0]}: unknown field (known: {', '.join(sorted(known))})")
    idle = doc.get("idle") or {}
    caps = doc.get("caps") or {}
    if not isinstance(idle, Mapping):
        raise PolicyError("idle: must be a table with minutes and/or cpu_below")
    if not isinstance(caps, Mapping):
        raise PolicyError("caps: must be a table with ram_gb, vram_gb and/or threads")
    for name, table, allowed in (
        ("idle", idle, {"minutes", "cpu_below"}),
        ("caps", caps, {"ram_gb", "vram_gb", "threads"}),
    ):
        extra = sorted(set(table) - allowed)
        if extra:
            raise PolicyError(f"{name}.{extra[0]}: unknown field")
    return policy_from_wire(
        {
            "timezone": doc.get("timezone"),
            "windows": doc.get("windows"),
            "handoff": doc.get("handoff"),
            "idle_minutes": idle.get("minutes"),
            "cpu_below": idle.get("cpu_below"),
            "caps": {
                "ram_bytes": _gib(caps.get("ram_gb"), "caps.ram_gb"),
                "vram_bytes": _gib(caps.get("vram_gb"), "caps.vram_gb"),
                "threads": caps.get("threads"),
            },
        }
    )


def load_policy_file(path: Path) -> LendingPolicy:
    try:
        text = path.read_text()
    except OSError as exc:
        raise PolicyError(f"--policy: cannot read {path}: {exc.strerror or exc}") from None
    try:
        doc = json.loads(text) if path.suffix.lower() == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise PolicyError(
            f"--policy: {path} is not valid {path.suffix.lstrip('.') or 'TOML'}: {exc}"
        ) from None
    if not isinstance(doc, dict):
        raise PolicyError(f"--policy: {path} must hold a table/object")
    return policy_from_document(doc)


def policy_with_flags(policy: LendingPolicy, overrides: Mapping[str, Any]) -> LendingPolicy:
    """Flags over the file: any of timezone, windows, idle_minutes, cpu_below, ram_gb, vram_gb,
    threads, handoff that is not None replaces the file's value."""
    wire = policy.to_wire()
    for key in ("timezone", "idle_minutes", "cpu_below", "handoff"):
        if overrides.get(key) is not None:
            wire[key] = overrides[key]
    if overrides.get("windows"):
        wire["windows"] = list(overrides["windows"])
    caps = dict(wire["caps"])
    if overrides.get("ram_gb") is not None:
        caps["ram_bytes"] = _gib(overrides["ram_gb"], "caps.ram_gb")
    if overrides.get("vram_gb") is not None:
        caps["vram_bytes"] = _gib(overrides["vram_gb"], "caps.vram_gb")
    if overrides.get("threads") is not None:
        caps["threads"] = overrides["threads"]
    wire["caps"] = caps
    return policy_from_wire(wire)


def check_caps(policy: LendingPolicy, hardware: Mapping[str, Any]) -> None:
    """A cap above the machine's size cannot be honoured: PolicyError naming the cap."""
    ram = int((hardware.get("memory") or {}).get("total") or 0)
    vram = sum(int(g.get("vram_total") or 0) for g in hardware.get("gpus") or [])
    threads = int((hardware.get("cpu") or {}).get("logical_cores") or 0)
    c = policy.caps
    if c.ram_bytes is not None and ram and c.ram_bytes > ram:
        raise PolicyError(
            f"caps.ram_gb: {c.ram_bytes / GiB:g} GB is more than this machine's {ram / GiB:.1f} GB"
        )
    if c.vram_bytes is not None and c.vram_bytes > vram:
        raise PolicyError(
            f"caps.vram_gb: {c.vram_bytes / GiB:g} GB is more than this machine's {vram / GiB:.1f} GB of VRAM"
        )
    if c.threads is not None and threads and c.threads > threads:
        raise PolicyError(
            f"caps.threads: {c.threads} is more than this machine's {threads} threads"
        )


# --- windows -------------------------------------------------------------------------------------


def _occurrences(policy: LendingPolicy, local: datetime) -> Iterable[tuple[datetime, datetime]]:
    """Window openings near ``local`` (yesterday through a week on), as local (start, end)."""
    midnight = local.replace(hour=0, minute=0, second=0, microsecond=0)
    for back in range(-1, 8):
        day = midnight + timedelta(days=back)
        for w in policy.windows:
            if day.weekday() in w.days:
                start = day + timedelta(minutes=w.start)
                yield start, start + timedelta(minutes=w.minutes)


def window_state(policy: LendingPolicy, now: datetime) -> tuple[bool, float | None]:
    """(open now, seconds until it closes). No windows: always open, never closes (None).

    ``now`` is an aware datetime; windows are read in the policy's time zone (wall clock).
    """
    if not policy.windows:
        return True, None
    local = now.astimezone(policy.zone).replace(tzinfo=None)
    spans = sorted(_occurrences(policy, local))
    end: datetime | None = None
    for start, stop in spans:  # merge overlapping/adjacent windows into one span
        if end is None:
            if start <= local < stop:
                end = stop
        elif start <= end:
            end = max(end, stop)
    if end is None:
        return False, None
    return True, (end - local).total_seconds()


# --- idle ----------------------------------------------------------------------------------------


class IdleSource(Protocol):
    def input_idle_seconds(self) -> float | None:
        """Seconds since the last keyboard/mouse input; None when it cannot be told."""

    def other_cpu_percent(self) -> float | None:
        """CPU load of processes other than this agent and its children, percent of the machine."""


@dataclass
class FakeIdleSource:
    """For tests: figures set by hand."""

    idle_seconds: float | None = None
    cpu_percent: float | None = None

    def input_idle_seconds(self) -> float | None:
        return self.idle_seconds

    def other_cpu_percent(self) -> float | None:
        return self.cpu_percent


_INPUT_IRQ = re.compile(r"i8042|keyboard|mouse|hid|usb|xhci|ehci|ohci|uhci", re.IGNORECASE)


class LinuxIdleSource:
    """Input activity from the interrupt counters of keyboard/mouse/USB lines in /proc/interrupts
    (works headless and without X), and other processes' CPU from psutil.

    Input idle time is the time since those counters last changed, as seen by this object's
    polls, so it starts counting when the agent starts.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last_counts: int | None = None
        self._last_change = clock()

    def _input_counts(self) -> int | None:
        try:
            lines = Path("/proc/interrupts").read_text().splitlines()
        except OSError:
            return None
        total, found = 0, False
        for line in lines[1:]:
            if _INPUT_IRQ.search(line):
                found = True
                total += sum(int(x) for x in line.split()[1:] if x.isdigit())
        return total if found else None

    def input_idle_seconds(self) -> float | None:
        counts = self._input_counts()
        if counts is None:
            return None
        now = self._clock()
        if counts != self._last_counts:
            if self._last_counts is not None:
                self._last_change = now
            self._last_counts = counts
        return now - self._last_change

    def other_cpu_percent(self) -> float | None:
        import psutil  # noqa: PLC0415 - heavy optional dependency, imported only when polled

        me = psutil.Process()
        ours = {me.pid, *(c.pid for c in me.children(recursive=True))}
        total = psutil.cpu_percent(interval=0.2)
        mine = 0.0
        for p in psutil.process_iter(["pid"]):
            if p.info["pid"] in ours:
                try:
                    mine += p.cpu_percent(interval=None)
                except psutil.Error:
                    pass
        cores = psutil.cpu_count() or 1
        return max(0.0, total - mine / cores)


def lending_open(
    policy: LendingPolicy, *, now: datetime, idle: IdleSource | None
) -> tuple[bool, str]:
    """Whether the policy lends now, and why not (one line) when it does not."""
    is_open, _ = window_state(policy, now)
    if not is_open:
        return False, "outside the lending window (" + ", ".join(
            w.text for w in policy.windows
        ) + ")"
    if idle is not None and policy.idle_minutes is not None:
        seconds = idle.input_idle_seconds()
        if seconds is not None and seconds < policy.idle_minutes * 60:
            return False, f"user input {seconds:.0f}s ago (idle-only: {policy.idle_minutes:g} min)"
    if idle is not None and policy.cpu_below is not None:
        load = idle.other_cpu_percent()
        if load is not None and load >= policy.cpu_below:
            return (
                False,
                f"other processes use {load:.0f}% CPU (idle-only: below {policy.cpu_below:g}%)",
            )
    return True, ""


def with_handoff(policy: LendingPolicy, handoff: str) -> LendingPolicy:
    if handoff not in HANDOFFS:
        raise PolicyError(f"handoff: must be failover or finish, got {handoff!r}")
    return replace(policy, handoff=handoff)


# --- the agent's monitor -------------------------------------------------------------------------


def pause_path(state_dir: Path) -> Path:
    """Written by ``node-agent pause`` (``{"id", "handoff", "at"}``), removed by ``resume``."""
    return state_dir / "pause.json"


def lending_status_path(state_dir: Path) -> Path:
    """Written by the running agent: ``{"paused", "reason", "handoff", "request", "updated_at"}``."""
    return state_dir / "lending.json"


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class LendingMonitor:
    """Pauses and resumes lending: on ``node-agent pause``/``resume`` (the pause file, polled
    every ``poll`` seconds) and when the policy closes or opens (evaluated every ``every``).

    A pause sends LENDING_PAUSED (the controller drains the node at once) and, with the failover
    handoff, hands each running job to another replica (``hand_off(job_id)``); with ``finish`` the
    jobs run to their end. A resume sends LENDING_RESUMED. ``policy`` is read on every evaluation,
    so a policy the owner set in the UI (the set_lending command) applies from the next one.
    """

    def __init__(
        self,
        *,
        state_dir: Path,
        policy: Callable[[], LendingPolicy],
        idle: IdleSource | None,
        event: Callable[[str, str, dict[str, Any]], None],
        hand_off: Callable[[], list[str]],
        clock: Callable[[], datetime] | None = None,
        poll: float = 0.2,
        every: float = 5.0,
    ) -> None:
        self.state_dir = state_dir
        self.policy = policy
        self.idle = idle
        self.event = event
        self.hand_off = hand_off
        self.clock = clock or (lambda: datetime.now().astimezone())
        self.poll = poll
        self.every = every
        self.paused = False
        self.reason = ""
        self.request: str | None = None
        self._policy_closed: tuple[bool, str] = (False, "")
        self._next_eval = 0.0
        self._written: tuple[bool, str] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.step(force=True)
        self._thread = threading.Thread(target=self._loop, name="lending", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)

    def _loop(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                self.step()
            except Exception:  # the monitor must outlive a bad poll (a /proc read, psutil)
                logging.getLogger("agent").exception("lending monitor")

    def step(self, *, force: bool = False) -> None:
        manual = read_json(pause_path(self.state_dir))
        mono = time.monotonic()
        if force or mono >= self._next_eval:
            self._next_eval = mono + self.every
            ok, why = lending_open(self.policy(), now=self.clock(), idle=self.idle)
            self._policy_closed = (not ok, why)
        if manual is not None:
            handoff = str(manual.get("handoff") or self.policy().handoff)
            want, reason = True, f"paused by the owner (handoff: {handoff})"
        elif self._policy_closed[0]:
            handoff = self.policy().handoff
            want, reason = True, self._policy_closed[1]
        else:
            handoff, want, reason = self.policy().handoff, False, ""
        request = str(manual.get("id")) if manual else None
        if want and not self.paused:
            self.paused, self.reason = True, reason
            data: dict[str, Any] = {"handoff": handoff, "reason": reason, "manual": bool(manual)}
            self.event("LENDING_PAUSED", reason, data)
            if handoff == "failover":
                handed = self.hand_off()
                if handed:
                    self.event(
                        "LENDING_HANDOFF",
                        f"{len(handed)} running job(s) handed to other replicas",
                        {"jobs": handed},
                    )
        elif not want and self.paused:
            self.paused, self.reason = False, ""
            self.event("LENDING_RESUMED", "lending resumed", {})
        if force or request != self.request or self._written != (self.paused, handoff):
            self.request = request
            self._written = (self.paused, handoff)
            self._write(handoff)

    def _write(self, handoff: str) -> None:
        body = {
            "paused": self.paused,
            "reason": self.reason,
            "handoff": handoff,
            "request": self.request,
            "updated_at": time.time(),
        }
        path = lending_status_path(self.state_dir)
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(body) + "\n")
            tmp.replace(path)
        except OSError:
            pass


# --- the owner's policy, set in the controller's UI ----------------------------------------------


def owner_policy_path(state_dir: Path) -> Path:
    """The policy the owner set in the controller's UI (the set_lending command), kept across
    restarts: ``{"policy": wire, "base": wire, "saved_at"}``. ``base`` is the policy the agent's
    own --policy file and flags gave when the owner first set one from the UI."""
    return state_dir / "owner-lending.json"


def owner_policy_save(state_dir: Path, policy: LendingPolicy, *, configured: LendingPolicy) -> Path:
    """Persist the owner's policy (mode 0600, atomically). ``configured`` is the policy of the
    --policy file and flags; an earlier save's ``base`` is kept, since the running policy may
    already be an owner's one."""
    path = owner_policy_path(state_dir)
    earlier = read_json(path) or {}
    base = earlier.get("base") if isinstance(earlier.get("base"), dict) else configured.to_wire()
    body = {"policy": policy.to_wire(), "base": base, "saved_at": time.time()}
    write_private_file(path, json.dumps(body, indent=2) + "\n")
    return path


def owner_policy_at_start(
    state_dir: Path, configured: LendingPolicy, *, hardware: Mapping[str, Any] | None = None
) -> tuple[LendingPolicy, Path | None]:
    """The policy to start with, and the owner's saved file when it is that one.

    The latest word wins: the owner's policy from the UI, unless the --policy file or the flags
    changed since it was set (they no longer give its ``base``): then they do, and the saved one
    is removed. Raises PolicyError naming the file when the saved policy no longer parses or,
    given the machine's ``hardware``, asks for more than it has (check_caps).
    """
    path = owner_policy_path(state_dir)
    if not path.exists():
        return configured, None
    saved = read_json(path)
    if saved is None or not isinstance(saved.get("policy"), dict):
        raise PolicyError(
            f"{path}: not a saved lending policy (delete it to use --policy and flags)"
        )
    if saved.get("base") != configured.to_wire():
        logging.getLogger("agent").info(
            "the --policy file or lending flags changed since the owner set a policy in the UI: "
            "using them (removing %s)",
            path,
        )
        path.unlink(missing_ok=True)
        return configured, None
    try:
        policy = policy_from_wire(saved["policy"])
        if hardware is not None:
            check_caps(policy, hardware)
        return policy, path
    except PolicyError as exc:
        raise PolicyError(f"{path}: {exc} (delete it to use --policy and flags)") from None
