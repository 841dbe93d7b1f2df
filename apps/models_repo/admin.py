from __future__ import annotations

from django.contrib import admin

from .models import Model, ModelFile, Replica


@admin.register(Model)
class ModelAdmin(admin.ModelAdmin):
    list_display = ("name", "family", "parameters", "price_weight_permille", "created_at")
    search_fields = ("name", "family")


@admin.register(ModelFile)
class ModelFileAdmin(admin.ModelAdmin):
    list_display = (
        "file_name",
        "model",
        "quantization",
        "architecture",
        "n_layer",
        "size",
        "sha256",
    )
    list_filter = ("quantization", "architecture")
    search_fields = ("file_name", "sha256")


@admin.register(Replica)
class ReplicaAdmin(admin.ModelAdmin):
    list_display = ("model_file", "node", "path", "verified_at")
    list_filter = ("node",)
