"""The one guarded state transition, shared by the three state machines (nodes, deployments, jobs).

Infrastructure: it knows no app. Each machine's ``<entity>_transition`` is a thin wrapper that
passes its model, its transition table, the event to write and what to broadcast.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Collection, Mapping
from typing import Any

from django.db import models, transaction


def transition_guarded(
    *,
    model: type[models.Model],
    pk: Any,
    to: str,
    table: Mapping[str, Collection[str]],
    expected: str | Collection[str] | None = None,
    fields: Mapping[str, Any] | None = None,
    record: Callable[[str], object] | None = None,
    after_commit: Callable[[str], None] | None = None,
    must_exist: bool = False,
    log: logging.Logger | None = None,
) -> str | None:
    """Move row ``pk`` to ``to`` if the table allows it and its state is still one of ``expected``.

    Returns the state it left, or None when nothing changed: a stale or duplicate caller finds the
    state already moved and changes nothing, so a late message can never move a state backwards.
    ``expected`` is one state, a named group, or None (whatever the state is now). The update is
    guarded on the state just read (``filter(pk=..., state=src)``, row count checked): a writer
    that moved the row between the read and the update makes it a no-op. ``record(src)`` writes the
    event row in the same transaction; ``after_commit(src)`` runs once the transaction commits
    (broadcasts, follow-up tasks). A missing row raises ``DoesNotExist`` with ``must_exist``; an
    arrow the table does not allow is logged to ``log`` when one is given.
    """
    manager = model._default_manager
    with transaction.atomic():
        current = manager.filter(pk=pk).values_list("state", flat=True).first()
        if current is None:
            if must_exist:
                raise model.DoesNotExist(f"{model._meta.model_name} {pk} does not exist")  # type: ignore[attr-defined]  # every concrete model has it; the stubs add it per model
            return None
        if expected is not None and current not in (
            {expected} if isinstance(expected, str) else expected
        ):
            return None
        src = str(current)
        if to not in table.get(src, ()):
            if log is not None and src != to:
                log.warning(
                    "refused illegal %s transition %s → %s",
                    model._meta.model_name,
                    src,
                    to,
                    extra={f"{model._meta.model_name}_id": str(pk)},
                )
            return None
        if manager.filter(pk=pk, state=src).update(state=to, **(fields or {})) != 1:
            return None
        if record is not None:
            record(src)
        if after_commit is not None:
            transaction.on_commit(functools.partial(after_commit, src))
    return src
