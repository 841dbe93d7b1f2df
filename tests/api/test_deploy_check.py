from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_check_deploy_passes_under_a_production_like_environment(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DEBUG", "DJANGO_SETTINGS_MODULE")} | {
        "DEBUG": "false",
        "SECRET_KEY": "a-real-production-secret-" + "q8Z" * 20,
        "NODE_ENROLLMENT_SECRET": "enroll-secret-" + "x" * 30,
        "AI_API_KEY": "rk_" + "y" * 40,
        "ALLOWED_HOSTS": "racon.example.lan",
        "SECURE_SSL_REDIRECT": "true",
        "SESSION_COOKIE_SECURE": "true",
        "CSRF_COOKIE_SECURE": "true",
        "SECURE_HSTS_SECONDS": "31536000",
        "SECURE_HSTS_INCLUDE_SUBDOMAINS": "true",
        "SECURE_HSTS_PRELOAD": "true",
        "RACON_VAR_DIR": str(tmp_path),
    }
    proc = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no issues" in proc.stdout


def test_check_deploy_flags_the_development_defaults(tmp_path: Path) -> None:
    env = {
        k: v for k, v in os.environ.items() if k not in ("SECRET_KEY", "DJANGO_SETTINGS_MODULE")
    } | {"RACON_VAR_DIR": str(tmp_path), "DEBUG": "false"}
    proc = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "SECRET_KEY" in proc.stdout + proc.stderr


def test_a_malformed_setting_is_a_clear_error(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"} | {
        "RACON_VAR_DIR": str(tmp_path),
        "HEARTBEAT_INTERVAL": "soon",
    }
    proc = subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "HEARTBEAT_INTERVAL='soon' is not a number" in proc.stderr
