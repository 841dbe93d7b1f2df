"""Deployments (placed model instances) and jobs (one per inference request)."""

from __future__ import annotations

import uuid

from django.db import models

from .states import DeploymentState, JobState


class Deployment(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    model = models.ForeignKey("models_repo.Model", on_delete=models.PROTECT, related_name="deployments")
    model_file = models.ForeignKey("models_repo.ModelFile", on_delete=models.PROTECT, related_name="deployments")
    state = models.CharField(max_length=16, choices=DeploymentState.choices, default=DeploymentState.PLANNING)
    primary = models.ForeignKey("nodes.Node", null=True, blank=True, on_delete=models.SET_NULL, related_name="primary_of")
    nodes = models.ManyToManyField("nodes.Node", related_name="deployments", blank=True)
    plan = models.JSONField(default=dict, help_text="scheduler Plan.to_dict()")
    request = models.JSONField(default=dict, help_text="placement request: n_ctx, slots, pins")
    n_ctx = models.PositiveIntegerField(default=2048)
    n_parallel = models.PositiveIntegerField(default=1)
    load_report = models.JSONField(default=dict, blank=True, help_text="what the runtime reported on load")
    error = models.TextField(blank=True)
    revision = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    stopped_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["model", "state"])]

    def __str__(self) -> str:
        return f"{self.model_id} {self.state}"


class Job(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    kind = models.CharField(max_length=16, default="chat")
    state = models.CharField(max_length=16, choices=JobState.choices, default=JobState.QUEUED)
    model = models.ForeignKey("models_repo.Model", on_delete=models.PROTECT, related_name="jobs")
    deployment = models.ForeignKey(Deployment, null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs")
    nodes = models.ManyToManyField("nodes.Node", related_name="jobs", blank=True)
    account = models.ForeignKey("credits.Account", null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs")
    api_key = models.ForeignKey("api.ApiKey", null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs")
    request_id = models.CharField(max_length=64, blank=True)
    stream = models.BooleanField(default=False)
    params = models.JSONField(default=dict, help_text="sampling parameters")
    max_tokens = models.PositiveIntegerField(default=256)
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    stream_chunks = models.PositiveIntegerField(default=0, help_text="TOKEN_STREAM_CHUNK count")
    finish_reason = models.CharField(max_length=16, blank=True)
    error = models.TextField(blank=True)
    failed_during_execution = models.BooleanField(null=True, blank=True)
    placement = models.JSONField(default=dict, blank=True, help_text="which node held which layers")
    ttft_ms = models.FloatField(null=True, blank=True)
    tokens_per_s = models.FloatField(null=True, blank=True)
    device_seconds = models.JSONField(default=dict, blank=True)
    priority = models.BigIntegerField(default=0)
    queued_at = models.DateTimeField(db_index=True)
    dispatched_at = models.DateTimeField(null=True, blank=True)
    first_token_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-queued_at"]
        indexes = [models.Index(fields=["state"]), models.Index(fields=["deployment", "state"])]

    def __str__(self) -> str:
        return f"job {self.id} {self.state}"
