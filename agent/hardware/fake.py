"""A JSON hardware profile that stands in for detection, so tests can pose as any machine.

A profile is a (partial) protocol.Hardware dict. Missing sections get modest defaults so that a
profile can say only what matters to a test ("memory": {...}, "gpus": [...]).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, cast

from agent.protocol import GpuInfo, Hardware

_DEFAULTS: dict[str, Any] = {
    "cpu": {
        "model": "Fake CPU",
        "arch": "x86_64",
        "physical_cores": 4,
        "logical_cores": 8,
        "flags": [],
    },
    "memory": {"total": 16 * 2**30, "available": 12 * 2**30},
    "swap": {"total": 0, "free": 0},
    "disk": {"path": "", "total": 500 * 2**30, "free": 200 * 2**30},
    "network": [
        {"name": "lo", "addresses": ["127.0.0.1"], "up": True, "speed_mbps": 0, "mtu": 65536}
    ],
    "gpus": [],
}


class ProfileError(ValueError):
    pass


def load_profile(path: Path) -> Hardware:
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ProfileError(f"hardware profile {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ProfileError(f"hardware profile {path}: top level must be an object")
    return profile_from_dict(raw, source=str(path))


def profile_from_dict(raw: dict[str, Any], *, source: str = "profile") -> Hardware:
    unknown = set(raw) - set(_DEFAULTS) - {"benchmark", "fingerprint"}
    if unknown:
        raise ProfileError(f"hardware profile {source}: unknown sections {sorted(unknown)}")
    hw: dict[str, Any] = copy.deepcopy(_DEFAULTS)
    for key in ("cpu", "memory", "swap", "disk"):
        if key in raw:
            if not isinstance(raw[key], dict):
                raise ProfileError(f"hardware profile {source}: {key!r} must be an object")
            hw[key].update(raw[key])
    for key in ("memory", "swap", "disk"):
        for k, v in hw[key].items():
            if k != "path" and (not isinstance(v, int) or v < 0):
                raise ProfileError(f"hardware profile {source}: {key}.{k} must be bytes >= 0")
    if "network" in raw:
        hw["network"] = list(raw["network"])
    gpus: list[GpuInfo] = []
    for i, g in enumerate(raw.get("gpus", [])):
        if not isinstance(g, dict) or "vram_total" not in g:
            raise ProfileError(f"hardware profile {source}: gpus[{i}] needs vram_total")
        total = int(g["vram_total"])
        gpus.append(
            GpuInfo(
                index=int(g.get("index", i)),
                vendor=str(g.get("vendor", "nvidia")),
                name=str(g.get("name", "Fake GPU")),
                uuid=str(g.get("uuid", f"GPU-fake-{i}")),
                vram_total=total,
                vram_free=int(g.get("vram_free", total)),
                driver=str(g.get("driver", "fake")),
            )
        )
        for key in ("gflops", "mem_bandwidth_gbps"):  # a benchmark's figures, as written
            if key in g:
                gpus[-1][key] = float(g[key])  # type: ignore[literal-required]  # one of the two keys above
        for key in ("device", "backend"):  # llama.cpp's names, as the real inventory has them
            if key in g:
                gpus[-1][key] = str(g[key])  # type: ignore[literal-required]  # one of the two keys above
        if g.get("software"):  # a software device (lavapipe), as the real inventory marks it
            gpus[-1]["software"] = True
    hw["gpus"] = gpus
    if "benchmark" in raw:
        hw["benchmark"] = {k: float(v) for k, v in raw["benchmark"].items()}
    return cast(Hardware, hw)
