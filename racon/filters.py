"""FilterSets used explicitly in a view (where the view must see a parameter before it filters)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django import forms
from django_filters import FilterSet, IsoDateTimeFilter
from django_filters.fields import IsoDateTimeField
from django_filters.utils import translate_validation


def filters_checked(filterset: FilterSet) -> dict[str, Any]:
    """The FilterSet's cleaned query parameters; a 400 in the API's error format naming each bad one."""
    if not filterset.is_valid():
        raise translate_validation(filterset.errors)
    return filterset.form.cleaned_data


class StrictFilterSet(FilterSet):
    """A FilterSet that refuses a filter parameter given with no value (``?account=``).

    django-filter reads a blank value as "no filter", so ``?account=`` would list everything the
    caller may see instead of refusing a value its schema (a UUID, an enum) never allows."""

    def is_valid(self) -> bool:
        valid = super().is_valid()
        if self.is_bound and not getattr(self, "_blanks_checked", False):
            self._blanks_checked = True
            for name in self.filters:
                if name in self.data and not str(self.data.get(name, "")).strip():
                    self.form.add_error(
                        name, f"{name} was given with no value; leave it out or give one"
                    )
        return valid and not self.form.errors


class _UtcIsoDateTimeField(IsoDateTimeField):
    """An ISO 8601 time, turned to UTC as it is read: PostgreSQL refuses offsets past ±15:59 that
    Python accepts (up to ±23:59), and a time that cannot be moved to UTC is out of range."""

    def to_python(self, value: Any) -> datetime | None:
        parsed = super().to_python(value)
        if parsed is None:
            return None
        try:
            return parsed.astimezone(UTC)
        except (OverflowError, ValueError):
            raise forms.ValidationError(
                "time out of range once moved to UTC", code="invalid"
            ) from None


class UtcIsoDateTimeFilter(IsoDateTimeFilter):
    field_class = _UtcIsoDateTimeField
