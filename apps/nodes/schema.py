"""The enrollment body's rules in the OpenAPI schema, where the serializers' fields cannot say them.

HardwareSerializer checks the inventory's dicts by hand (validate_cpu, validate_memory) and against
the plausibility bounds (services.hardware_bounds_errors, NODE_MAX_* settings): these extensions
state the same keys and bounds, read from the settings when the schema is built. Two rules stay
in words only, as JSON Schema cannot compare two values: memory.available <= memory.total and a
GPU's vram_free <= its vram_total.

Registered by NodesConfig.ready(); the targets are named by path, so this module imports no view.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from drf_spectacular.extensions import OpenApiSerializerExtension
from drf_spectacular.plumbing import force_instance


def _count(maximum: float) -> dict[str, Any]:
    return {"type": "integer", "minimum": 0, "maximum": maximum}


def _figure(maximum: float) -> dict[str, Any]:
    return {"type": "number", "minimum": 0, "maximum": maximum}


class _RequestExtension(OpenApiSerializerExtension):
    """Maps the serializer as usual, then lets refine() add the request body's rules."""

    def map_serializer(self, auto_schema: Any, direction: Any) -> Any:
        schema = auto_schema._map_serializer(self.target, direction, bypass_extensions=True)
        if direction == "request":
            self.refine(schema["properties"])
        return schema

    def refine(self, properties: dict[str, Any]) -> None:
        """The request body's rules, added to the mapped ``properties``: each subclass's own."""

    def max_items(self, name: str) -> int:
        """The max_length a many=True field passes to its ListSerializer (the schema misses it)."""
        return int(force_instance(self.target).fields[name].max_length)


class HardwareSchema(_RequestExtension):
    target_class = "apps.nodes.api.HardwareSerializer"

    def refine(self, properties: dict[str, Any]) -> None:
        mem_max = settings.NODE_MAX_MEMORY_BYTES
        properties["cpu"] = {
            "type": "object",
            "properties": {
                "model": {"type": "string"},
                "physical_cores": _count(settings.NODE_MAX_CORES),
                "logical_cores": _count(settings.NODE_MAX_CORES),
            },
            "required": ["model", "physical_cores", "logical_cores"],
            "additionalProperties": {},
        }
        properties["memory"] = {
            "type": "object",
            "properties": {"total": _count(mem_max), "available": _count(mem_max)},
            "required": ["total"],
            "additionalProperties": _count(mem_max),
            "description": "bytes; available is at most total",
        }
        properties["swap"] = {"type": "object", "additionalProperties": _count(mem_max)}
        disk_max = settings.NODE_MAX_DISK_BYTES
        properties["disk"] = {
            "type": "object",
            "properties": {"total": _figure(disk_max), "free": _figure(disk_max)},
            "additionalProperties": {},
        }
        properties["gpus"]["maxItems"] = self.max_items("gpus")
        properties["benchmark"] = {
            "type": "object",
            "properties": {
                "gflops": _figure(settings.NODE_MAX_GFLOPS),
                "mem_bandwidth_gbps": _figure(settings.NODE_MAX_BANDWIDTH_GBPS),
            },
            "additionalProperties": {"type": "number", "minimum": 0},
        }


class GpuSchema(_RequestExtension):
    target_class = "apps.nodes.api.GpuSerializer"

    def refine(self, properties: dict[str, Any]) -> None:
        vram_max = settings.NODE_MAX_VRAM_BYTES
        properties["vram_total"]["maximum"] = vram_max
        properties["vram_free"]["maximum"] = vram_max
        properties["vram_free"]["description"] = "bytes; at most vram_total"
        # A GPU's own figures may be far above the CPU benchmark's bounds (hardware_bounds_errors).
        for key, bound in (
            ("gflops", settings.NODE_MAX_GFLOPS * 100),
            ("mem_bandwidth_gbps", settings.NODE_MAX_BANDWIDTH_GBPS * 5),
        ):
            if key in properties:
                properties[key]["maximum"] = bound


class EnrollRequestSchema(_RequestExtension):
    target_class = "apps.nodes.api.EnrollRequestSerializer"

    def refine(self, properties: dict[str, Any]) -> None:
        # IPAddressField(protocol="both"): an IPv4 or an IPv6 address.
        properties["advertise_address"] = {
            "type": "string",
            "anyOf": [{"format": "ipv4"}, {"format": "ipv6"}],
        }
        properties["models"]["maxItems"] = self.max_items("models")
