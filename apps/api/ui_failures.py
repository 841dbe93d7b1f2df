"""Readable failures: a deployment's or a job's stored error as a one-line summary, the full cause,
and the next step to take.

The hint is read from the controller's own error texts (the services write them; a node's text is
quoted inside them). It only picks the advice shown next to the full cause, which is always shown
verbatim, so an unrecognised error still reads in full with a generic next step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_HTTP = re.compile(r"\b(40[0-9]|50[0-9])\b")

# (pattern over the error, what went wrong, the next step). First match wins.
_HINTS: tuple[tuple[re.Pattern[str], str, str], ...] = (
    (
        re.compile(r"fetch_model|model transfer|transfer failed", re.I),
        "the node could not fetch the model{http}",
        "check the node's controller URL and that the controller is reachable from it "
        "(`node-agent status` on the node); a 401 or 403 means its credential was refused: "
        "re-enrol it from the Tokens page",
    ),
    (
        re.compile(r"sha256|digest|checksum", re.I),
        "the model file on the node does not match the registered one",
        "delete the node's copy (it is fetched again) or register the file again on the Models page",
    ),
    (
        re.compile(
            r"out of memory|\bOOM\b|failed to allocate|does not fit|not enough memory", re.I
        ),
        "there was not enough memory for the plan",
        "choose more nodes or a smaller context (n_ctx) in the preview, or free memory on the nodes",
    ),
    (
        re.compile(r"rpc|tunnel", re.I),
        "a node of the split could not reach another's RPC worker",
        "check the link between the nodes on the Nodes page (links matrix) and that no firewall "
        "blocks the tunnel port; the preview shows which node holds which layers",
    ),
    (
        re.compile(r"went OFFLINE|went ERROR|lost|no answer|timed out|timeout", re.I),
        "a node of the plan stopped answering",
        "open the node's page: its heartbeat age and last events say whether it is down or "
        "overloaded; `racon diagnose NODE` writes a bundle with its logs",
    ),
    (
        re.compile(r"Public IP", re.I),
        "a node advertised a public address",
        "RPC peers must be on a private network: set the node's --advertise-address to its LAN address",
    ),
    (
        re.compile(r"stopped|cancel", re.I),
        "it was stopped",
        "nothing to fix: deploy again from this page when it is wanted",
    ),
)
_GENERIC = (
    "it failed",
    "open the nodes' pages for their events, or run `racon diagnose NODE` for a bundle",
)


@dataclass(frozen=True)
class Failure:
    summary: str  # "the node could not fetch the model: 401 from the controller"
    cause: str  # the stored error, verbatim
    next_step: str


def failure_explained(error: str) -> Failure | None:
    """The summary and next step for a stored error; None when there is no error."""
    if not error:
        return None
    for pattern, what, step in _HINTS:
        if pattern.search(error):
            code = _HTTP.search(error)
            http = f": {code.group(1)} from the controller" if code and "{http}" in what else ""
            return Failure(summary=what.replace("{http}", http), cause=error, next_step=step)
    return Failure(summary=_GENERIC[0], cause=error, next_step=_GENERIC[1])
