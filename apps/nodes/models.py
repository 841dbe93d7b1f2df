"""Node registry, enrollment tokens and the append-only event log."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.db import models

from .states import NodeState


class EventCategory(models.TextChoices):
    LIFECYCLE = "LIFECYCLE"
    HEALTH = "HEALTH"
    EXECUTION = "EXECUTION"
    RUNTIME = "RUNTIME"
    INFERENCE = "INFERENCE"
    MANAGEMENT = "MANAGEMENT"
    SECURITY = "SECURITY"
    PLACEMENT = "PLACEMENT"
    CREDITS = "CREDITS"


class EnrollmentToken(models.Model):
    """An administrator-issued token. Only its HMAC (keyed by NODE_ENROLLMENT_SECRET) is stored."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    label = models.CharField(max_length=120)
    token_hash = models.CharField(max_length=64, unique=True)
    prefix = models.CharField(max_length=12, help_text="first characters, to recognise a token")
    account = models.ForeignKey(
        "accounts.Account", on_delete=models.PROTECT, related_name="enrollment_tokens"
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL
    )
    expires_at = models.DateTimeField()
    max_uses = models.PositiveIntegerField(default=1)
    uses = models.PositiveIntegerField(default=0)
    revoked_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.label} ({self.prefix}…)"


class Node(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=120)
    # From the world-readable /etc/machine-id: it names a machine within an account only
    # (node_machine_unique_per_account), so nobody can squat another account's machine (issue 28).
    machine_id = models.CharField(max_length=128)
    account = models.ForeignKey("accounts.Account", on_delete=models.PROTECT, related_name="nodes")
    enrollment_token = models.ForeignKey(
        EnrollmentToken, null=True, blank=True, on_delete=models.SET_NULL
    )
    state = models.CharField(
        max_length=16, choices=NodeState.choices, default=NodeState.UNINITIALIZED
    )
    state_changed_at = models.DateTimeField(null=True, blank=True)
    credential_hash = models.CharField(max_length=64)
    revoked_at = models.DateTimeField(null=True, blank=True)
    agent_version = models.CharField(max_length=32, blank=True)
    address = models.CharField(max_length=64, help_text="private advertise address")
    rpc_port = models.PositiveIntegerField(default=50052)
    # Structured inventory as the agent sent it (protocol.Hardware), plus the figures the scheduler
    # and the dashboard aggregate, denormalised so a cluster snapshot is one query.
    hardware = models.JSONField(default=dict)
    cpu_model = models.CharField(max_length=200, blank=True)
    cpu_physical_cores = models.PositiveIntegerField(default=0)
    cpu_logical_cores = models.PositiveIntegerField(default=0)
    ram_total = models.BigIntegerField(default=0)
    ram_available = models.BigIntegerField(default=0)
    vram_total = models.BigIntegerField(default=0)
    vram_free = models.BigIntegerField(default=0)
    gpu_count = models.PositiveIntegerField(default=0)
    disk_free = models.BigIntegerField(default=0)
    # What the scheduler uses: the claim once a speed challenge confirmed it (or the claim itself
    # when SPEED_CHALLENGE is off), else at most SPEED_UNVERIFIED_GFLOPS. gflops_claimed is the
    # agent's own benchmark figure; a changed claim is challenged again.
    gflops = models.FloatField(default=0)
    gflops_claimed = models.FloatField(default=0)
    speed_verified_at = models.DateTimeField(null=True, blank=True)
    mem_bandwidth_gbps = models.FloatField(default=0)
    # The operator's drain, kept through an OFFLINE spell (the next heartbeat drains again); the
    # drain's progress is the state itself (DRAINING → DRAINED, with NODE_DRAINED).
    drain_requested = models.BooleanField(default=False)
    # Who asked for it: "operator" (the API, UI, CLI) or "lending" (the agent's own pause). The
    # agent's resume lifts only a "lending" drain; an operator's drain during a pause takes it over.
    drain_requested_by = models.CharField(max_length=16, blank=True, default="")
    # The owner's lending terms (apps/nodes/lending.py): {"policy": LendingPolicy wire form,
    # "source": "agent" | "owner", "paused": {"handoff", "reason", "at"} while paused}.
    lending = models.JSONField(default=dict, blank=True)
    last_heartbeat_at = models.DateTimeField(
        null=True, blank=True, help_text="as of the last state change"
    )
    enrolled_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        indexes = [models.Index(fields=["state"])]
        constraints = [
            models.UniqueConstraint(
                fields=["account", "name"],
                condition=models.Q(revoked_at__isnull=True),
                name="node_name_unique_per_account",
                violation_error_message="node names are unique within an account",
            ),
            models.UniqueConstraint(
                fields=["account", "machine_id"],
                name="node_machine_unique_per_account",
                violation_error_message="a machine is enrolled once within an account",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.state})"


class Event(models.Model):
    """Append-only: real transitions and notable facts, never one row per heartbeat or token."""

    id = models.BigAutoField(primary_key=True)
    kind = models.CharField(max_length=40, db_index=True)
    category = models.CharField(max_length=16, choices=EventCategory.choices)
    node = models.ForeignKey(
        Node, null=True, blank=True, on_delete=models.SET_NULL, related_name="events"
    )
    job = models.ForeignKey(
        "jobs.Job", null=True, blank=True, on_delete=models.SET_NULL, related_name="events"
    )
    deployment = models.ForeignKey(
        "jobs.Deployment", null=True, blank=True, on_delete=models.SET_NULL, related_name="events"
    )
    old_state = models.CharField(max_length=16, blank=True)
    new_state = models.CharField(max_length=16, blank=True)
    message = models.CharField(max_length=500, blank=True)
    data = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.kind} {self.message}"
