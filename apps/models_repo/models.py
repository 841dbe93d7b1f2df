"""Models, their GGUF files, and which node holds which file."""

from __future__ import annotations

import uuid

from django.db import models


class Model(models.Model):
    """A model as the API names it (``model`` in /v1 requests)."""

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(max_length=200, unique=True)
    family = models.CharField(max_length=100, blank=True)
    parameters = models.BigIntegerField(default=0, help_text="parameter count")
    # Value of one token relative to the base rate (CREDITS_MICRO_PER_TOKEN), in permille.
    price_weight_permille = models.PositiveIntegerField(default=1000)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class ModelFile(models.Model):
    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    model = models.ForeignKey(Model, on_delete=models.CASCADE, related_name="files")
    file_name = models.CharField(max_length=255)
    format = models.CharField(max_length=16, default="GGUF")
    quantization = models.CharField(max_length=32, blank=True)
    sha256 = models.CharField(max_length=64, unique=True)
    size = models.BigIntegerField()
    architecture = models.CharField(max_length=64, blank=True)
    n_layer = models.PositiveIntegerField(default=0)
    n_embd = models.PositiveIntegerField(default=0)
    n_head = models.PositiveIntegerField(default=0)
    n_head_kv = models.PositiveIntegerField(default=0)
    n_ctx_train = models.PositiveIntegerField(default=0)
    layer_bytes = models.JSONField(default=list, help_text="weight bytes of each layer")
    profile = models.JSONField(default=dict, help_text="ModelProfile.to_dict()")
    store_path = models.CharField(
        max_length=500, blank=True, help_text="copy in the controller's model store"
    )
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"{self.file_name} ({self.quantization})"


class Replica(models.Model):
    """A node holds a file at a path; verified by sha256 when last reported."""

    node = models.ForeignKey("nodes.Node", on_delete=models.CASCADE, related_name="replicas")
    model_file = models.ForeignKey(ModelFile, on_delete=models.CASCADE, related_name="replicas")
    path = models.CharField(max_length=500)
    verified_at = models.DateTimeField()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["node", "model_file"], name="one_replica_per_node_file")
        ]

    def __str__(self) -> str:
        return f"{self.model_file} on {self.node_id}"
