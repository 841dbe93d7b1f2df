"""Query parameters of the node and event lists (django-filter: checked, and documented in /api/schema/)."""

from __future__ import annotations

import django_filters as filters

from racon.filters import StrictFilterSet, UtcIsoDateTimeFilter

from .models import Event, EventCategory, Node
from .states import NodeState


class NodeFilter(StrictFilterSet):
    state = filters.ChoiceFilter(choices=NodeState.choices)
    name = filters.CharFilter(lookup_expr="icontains", help_text="part of the node's name")

    class Meta:
        model = Node
        fields: list[str] = []


class EventFilter(StrictFilterSet):
    kind = filters.CharFilter()
    category = filters.ChoiceFilter(choices=EventCategory.choices)
    node = filters.UUIDFilter(field_name="node_id")
    job = filters.UUIDFilter(field_name="job_id")
    deployment = filters.UUIDFilter(field_name="deployment_id")
    since = UtcIsoDateTimeFilter(
        field_name="created_at", lookup_expr="gte", help_text="ISO 8601, inclusive"
    )
    until = UtcIsoDateTimeFilter(
        field_name="created_at", lookup_expr="lt", help_text="ISO 8601, exclusive"
    )

    class Meta:
        model = Event
        fields: list[str] = []
