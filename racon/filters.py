"""FilterSets used explicitly in a view (where the view must see a parameter before it filters)."""

from __future__ import annotations

from typing import Any

from django_filters import FilterSet
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
