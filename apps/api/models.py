"""API keys: AI_API_KEY from the environment plus per-account keys stored hashed."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models


class ApiKey(models.Model):
    SCOPE_INFERENCE = "inference"
    SCOPE_ADMIN = "admin"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=120)
    prefix = models.CharField(max_length=16, db_index=True)
    key_hash = models.CharField(max_length=64, unique=True)
    account = models.ForeignKey("credits.Account", on_delete=models.CASCADE, related_name="api_keys")
    user = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE)
    scopes = models.JSONField(default=list, help_text='subset of ["inference", "admin"]')
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}…)"
