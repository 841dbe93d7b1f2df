"""Deployments (placed model instances) and jobs (one per inference request)."""

from __future__ import annotations

import uuid

from django.db import models

from apps.nodes.states import Engine

from .states import DeploymentState, JobState


class Deployment(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    model = models.ForeignKey(
        "models_repo.Model", on_delete=models.PROTECT, related_name="deployments"
    )
    model_file = models.ForeignKey(
        "models_repo.ModelFile", on_delete=models.PROTECT, related_name="deployments"
    )
    # The engine that serves it (issue 30): llama.cpp's llama-server, or vLLM on one node.
    engine = models.CharField(
        max_length=16,
        choices=Engine.choices,
        default="llamacpp",
    )
    state = models.CharField(
        max_length=16, choices=DeploymentState.choices, default=DeploymentState.PLANNING
    )
    primary = models.ForeignKey(
        "nodes.Node", null=True, blank=True, on_delete=models.SET_NULL, related_name="primary_of"
    )
    nodes = models.ManyToManyField("nodes.Node", related_name="deployments", blank=True)
    plan = models.JSONField(default=dict, help_text="scheduler Plan.to_dict()")
    request = models.JSONField(default=dict, help_text="placement request: n_ctx, slots, pins")
    n_ctx = models.PositiveIntegerField(default=2048)
    n_parallel = models.PositiveIntegerField(default=1)
    load_report = models.JSONField(
        default=dict, blank=True, help_text="what the runtime reported on load"
    )
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
    deployment = models.ForeignKey(
        Deployment, null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs"
    )
    nodes = models.ManyToManyField("nodes.Node", related_name="jobs", blank=True)
    account = models.ForeignKey(
        "accounts.Account", null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs"
    )
    api_key = models.ForeignKey(
        "accounts.ApiKey", null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs"
    )
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
    queued_at = models.DateTimeField(db_index=True)
    dispatched_at = models.DateTimeField(null=True, blank=True)
    first_token_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-queued_at"]
        indexes = [models.Index(fields=["state"]), models.Index(fields=["deployment", "state"])]

    def __str__(self) -> str:
        return f"job {self.id} {self.state}"


class JobAttempt(models.Model):
    """One run of a job on one deployment. A job that never failed over has no rows: its one
    attempt is the job itself. At the first failover the first attempt is recorded from the job
    and each later one as it is dispatched; settlement pays each attempt's plan for the tokens
    that attempt produced, as the controller counted them from its stream."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="attempts")
    number = models.PositiveIntegerField()
    deployment = models.ForeignKey(
        Deployment, null=True, blank=True, on_delete=models.SET_NULL, related_name="job_attempts"
    )
    primary = models.ForeignKey(
        "nodes.Node", null=True, blank=True, on_delete=models.SET_NULL, related_name="job_attempts"
    )
    plan = models.JSONField(
        default=dict,
        blank=True,
        help_text="the deployment's plan when the attempt ran (settlement)",
    )
    started_at = models.DateTimeField()
    ended_at = models.DateTimeField(null=True, blank=True)
    completion_tokens = models.PositiveIntegerField(
        default=0, help_text="counted by the controller from this attempt's stream"
    )
    chunks = models.PositiveIntegerField(default=0)
    outcome = models.CharField(
        max_length=32,
        blank=True,
        help_text="empty while running; COMPLETED, FAILED, CANCELLED or the failover cause",
    )
    error = models.TextField(blank=True)

    class Meta:
        ordering = ["job", "number"]
        constraints = [
            models.UniqueConstraint(fields=["job", "number"], name="job_attempt_unique_number")
        ]

    def __str__(self) -> str:
        return f"job {self.job_id} attempt {self.number} {self.outcome or 'running'}"


class MinuteRollup(models.Model):
    """Per-minute figures for the web UI's charts, written by ``apps/jobs/rollup.py`` (beat, every
    ROLLUP_PERIOD_SECONDS) from the jobs and the nodes' Redis telemetry, and deleted after
    ROLLUP_RETENTION_HOURS. One row per minute and scope: ``pool`` (every job), ``model:<id>``
    (that model's jobs) or ``node:<id>`` (the jobs the node took part in, and a telemetry sample)."""

    minute = models.DateTimeField(help_text="start of the minute (UTC)")
    scope = models.CharField(max_length=48, help_text="pool, model:<id> or node:<id>")
    model = models.ForeignKey(
        "models_repo.Model", null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    node = models.ForeignKey(
        "nodes.Node", null=True, blank=True, on_delete=models.CASCADE, related_name="+"
    )
    requests = models.PositiveIntegerField(default=0, help_text="jobs that ended in the minute")
    failed = models.PositiveIntegerField(default=0)
    prompt_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0, help_text="counted by the controller")
    layers = models.BigIntegerField(default=0, help_text="layers held, summed over the jobs")
    ttft_p50_ms = models.FloatField(null=True, blank=True, help_text="queued → first token")
    ttft_p95_ms = models.FloatField(null=True, blank=True)
    cpu_percent = models.FloatField(null=True, blank=True, help_text="node rows: telemetry")
    mem_used_bytes = models.BigIntegerField(null=True, blank=True)

    class Meta:
        ordering = ["minute"]
        constraints = [
            models.UniqueConstraint(fields=["minute", "scope"], name="minute_rollup_unique_scope")
        ]
        indexes = [models.Index(fields=["scope", "minute"])]

    def __str__(self) -> str:
        return f"{self.scope} {self.minute:%Y-%m-%d %H:%M}"
