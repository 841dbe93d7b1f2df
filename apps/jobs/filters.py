"""Query parameters of the deployment and job lists (django-filter: checked, and documented in /api/schema/)."""

from __future__ import annotations

import django_filters as filters
from django.db.models import QuerySet
from rest_framework.exceptions import NotFound

from apps.nodes.models import Node
from racon import ids
from racon.filters import StrictFilterSet, UtcIsoDateTimeFilter

from .models import Deployment, Job
from .states import DeploymentState, JobState


class DeploymentFilter(StrictFilterSet):
    state = filters.ChoiceFilter(choices=DeploymentState.choices)
    model = filters.CharFilter(field_name="model__name", help_text="model name")

    class Meta:
        model = Deployment
        fields: list[str] = []


class JobFilter(StrictFilterSet):
    state = filters.ChoiceFilter(choices=JobState.choices)
    model = filters.CharFilter(field_name="model__name", help_text="model name")
    node = filters.CharFilter(
        method="filter_node", help_text="node id or name: jobs that ran on it"
    )
    since = UtcIsoDateTimeFilter(
        field_name="queued_at", lookup_expr="gte", help_text="ISO 8601, inclusive"
    )
    until = UtcIsoDateTimeFilter(
        field_name="queued_at", lookup_expr="lt", help_text="ISO 8601, exclusive"
    )

    class Meta:
        model = Job
        fields: list[str] = []

    def filter_node(self, queryset: QuerySet[Job], name: str, value: str) -> QuerySet[Job]:
        try:
            node_id = ids.node_id(value)
        except ValueError:
            found = Node.objects.filter(name=value).values_list("id", flat=True).first()
            if found is None:
                raise NotFound(f"unknown node {value!r}") from None
            node_id = ids.node_id(found)
        return queryset.filter(nodes__id=node_id)
