"""The command envelope's checks: signed for this node, fresh, and never run before.

The controller signs every command with this node's command key (agent/protocol.py,
command_signature). Whoever can write to the node's queue without that key (another node, a
LAN host that reached Redis, the controller's own Redis user replaying a captured command) gets a
refusal, reported as a command_result with a ``code`` (protocol.COMMAND_REFUSALS).

The replay cache holds the ids of commands this agent accepted, until their issue time is older
than the maximum age (from then on the age check refuses them): in memory from acceptance, and
in ``commands-seen`` in the state dir (mode 0600) once done, so a restart does not reopen the
window. It is bounded (``capacity``): past it the oldest ids go first.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.identity import write_private_file
from agent.protocol import COMMAND_CLOCK_SKEW_SECONDS, command_signature

log = logging.getLogger("agent")

SEEN_FILE = "commands-seen"
REPLAY_CAPACITY = 200_000


class CommandRefused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class CommandGuard:
    def __init__(
        self,
        *,
        node_id: Callable[[], str | None],
        key: Callable[[], bytes | None],
        max_age: float,
        state_dir: Path | None,
        clock: Callable[[], float] = time.time,
        capacity: int = REPLAY_CAPACITY,
    ) -> None:
        self.node_id = node_id
        self.key = key
        self.max_age = max_age
        self.clock = clock
        self.capacity = capacity
        self.path = state_dir / SEEN_FILE if state_dir is not None else None
        self._seen: OrderedDict[str, float] = OrderedDict()  # id → issue time, oldest first
        self._running: set[str] = set()  # accepted, not yet done: a crash must let them run again
        self._done_lines = 0
        self._lock = threading.Lock()
        self._load()

    # --- the checks ---------------------------------------------------------------------------

    def check(self, command: dict[str, Any]) -> None:
        """Raise CommandRefused unless the command is signed for this node, fresh and new.

        A command that passes is in the replay cache from now on: a copy is refused even while
        the first one runs.
        """
        cid, kind = str(command["id"]), str(command["kind"])
        sig, to, issued = command.get("sig"), command.get("node_id"), command.get("issued_at")
        if not isinstance(sig, str) or not sig or not isinstance(to, str):
            raise CommandRefused(
                "command_unsigned",
                f"refused unsigned command {cid} ({kind}): every command must carry the "
                "controller's signature and the node id it is for",
            )
        key, me = self.key(), self.node_id()
        if key is None or me is None:
            raise CommandRefused(
                "command_bad_signature",
                f"refused command {cid} ({kind}): this agent has no command key yet "
                "(it asks the controller in its heartbeats)",
            )
        if not isinstance(issued, int | float) or isinstance(issued, bool):
            raise CommandRefused("command_unsigned", f"refused command {cid}: no issue time")
        payload = command.get("payload") or {}
        want = command_signature(
            key, node_id=to, command_id=cid, kind=kind, payload=payload, issued_at=issued
        )
        if to != me:
            # Refused whatever its signature: another node's command (its signature would not
            # verify here, being under that node's key) or a forged address.
            raise CommandRefused(
                "command_wrong_node",
                f"refused command {cid} ({kind}): it is addressed to node {to}, not this node {me}",
            )
        if not hmac.compare_digest(want, sig):
            raise CommandRefused(
                "command_bad_signature",
                f"refused command {cid} ({kind}): its signature does not verify under this "
                "node's command key",
            )
        now = self.clock()
        age = now - float(issued)
        if age > self.max_age or age < -COMMAND_CLOCK_SKEW_SECONDS:
            raise CommandRefused(
                "command_stale",
                f"refused command {cid} ({kind}): issued {age:.0f}s ago, outside this agent's "
                f"--command-max-age of {self.max_age:.0f}s (or the controller's clock is off)",
            )
        with self._lock:
            if cid in self._seen:
                raise CommandRefused(
                    "command_replayed",
                    f"refused command {cid} ({kind}): this id was already run here (a replay)",
                )
            self._seen[cid] = float(issued)
            self._running.add(cid)
            self._prune(now)

    def done(self, command: dict[str, Any] | None) -> None:
        """An accepted command is finished and acknowledged: keep its id across a restart."""
        if command is None or self.path is None or not command.get("sig"):
            return
        issued = command.get("issued_at")
        if not isinstance(issued, int | float) or isinstance(issued, bool):
            return
        with self._lock:
            if str(command["id"]) not in self._running:
                return  # refused, or not accepted by this process: nothing to keep
            self._running.discard(str(command["id"]))
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                with os.fdopen(fd, "a") as f:
                    f.write(f"{float(issued)!r} {command['id']}\n")
                self._done_lines += 1
                if self._done_lines > 2 * max(len(self._seen), 1000):
                    self._compact()
            except OSError as exc:
                log.warning("cannot keep command id %s in %s: %s", command["id"], self.path, exc)

    # --- the cache ----------------------------------------------------------------------------

    def _prune(self, now: float) -> None:
        horizon = now - self.max_age - COMMAND_CLOCK_SKEW_SECONDS
        for cid, issued in list(self._seen.items()):
            if issued >= horizon and len(self._seen) <= self.capacity:
                break
            del self._seen[cid]

    def _load(self) -> None:
        if self.path is None:
            return
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("cannot read %s: %s", self.path, exc)
            return
        entries: list[tuple[float, str]] = []
        for line in lines:
            when, _, cid = line.partition(" ")
            try:
                entries.append((float(when), cid))
            except ValueError:
                continue
        for issued, cid in sorted(entries):
            if cid:
                self._seen[cid] = issued
        self._prune(self.clock())
        self._done_lines = len(lines)
        self._compact()

    def _compact(self) -> None:
        assert self.path is not None
        self._prune(self.clock())
        text = "".join(
            f"{issued!r} {cid}\n" for cid, issued in self._seen.items() if cid not in self._running
        )
        write_private_file(self.path, text)
        self._done_lines = len(self._seen)
