"""Query parameters of the ledger and receipt lists (django-filter: checked, and documented in /api/schema/).

``account`` filters nothing here: the view reads it to choose whose rows to show (staff only for
another account's) and starts from that account's rows.
"""

from __future__ import annotations

from typing import Any
from uuid import UUID

import django_filters as filters
from django.db.models import QuerySet

from racon.filters import StrictFilterSet, UtcIsoDateTimeFilter

from .models import EntryKind, Posting, Receipt


def _chosen_by_the_view(queryset: QuerySet[Any], name: str, value: UUID) -> QuerySet[Any]:
    return queryset


class LedgerFilter(StrictFilterSet):
    account = filters.UUIDFilter(
        method=_chosen_by_the_view, help_text="account id (staff only; default: yours)"
    )
    kind = filters.ChoiceFilter(field_name="entry__kind", choices=EntryKind.choices)
    since = UtcIsoDateTimeFilter(
        field_name="entry__created_at", lookup_expr="gte", help_text="ISO 8601, inclusive"
    )
    until = UtcIsoDateTimeFilter(
        field_name="entry__created_at", lookup_expr="lt", help_text="ISO 8601, exclusive"
    )

    class Meta:
        model = Posting
        fields: list[str] = []


class ReceiptFilter(StrictFilterSet):
    account = filters.UUIDFilter(
        method=_chosen_by_the_view, help_text="staff only: receipts of this account's nodes"
    )
    job = filters.UUIDFilter(field_name="job_id")
    node = filters.UUIDFilter(field_name="node_id")

    class Meta:
        model = Receipt
        fields: list[str] = []
