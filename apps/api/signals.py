"""Cache invalidation on writes the ORM signals: API keys and models (racon/cache.py); and the
metrics of finished jobs (apps.jobs.hooks.job_finished, sent by jobs, which never imports api).

Writes through ``QuerySet.update()`` send no signal; those call ``cache.invalidate`` themselves
(``api_key_revoke``, ``deployment_transition``).
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.db.models.signals import post_delete, post_save

from apps.accounts.models import Account, ApiKey
from apps.jobs.hooks import job_finished
from apps.jobs.serving import MODEL_CACHE
from apps.models_repo.models import Model, ModelFile
from racon import cache
from racon.ids import JobId

from .auth import PRINCIPAL_CACHE
from .metrics import job_finished_observe


def _principal_changed(**kwargs: Any) -> None:
    cache.invalidate(PRINCIPAL_CACHE)


def _model_changed(**kwargs: Any) -> None:
    cache.invalidate(MODEL_CACHE)


def _job_finished(*, job_id: JobId, state: str, fields: dict[str, Any], **kwargs: Any) -> None:
    job_finished_observe(job_id=job_id, state=state, fields=fields, row=kwargs.get("row"))


def connect() -> None:
    job_finished.connect(_job_finished, dispatch_uid="racon-metrics-job-finished")
    # A deactivated user's keys and an account's changed limits act at once in every process.
    for sender, name in ((get_user_model(), "user"), (Account, "account")):
        post_save.connect(_principal_changed, sender=sender, dispatch_uid=f"racon-cache-{name}")
    for signal in (post_save, post_delete):
        signal.connect(
            _principal_changed,
            sender=ApiKey,
            dispatch_uid=f"racon-cache-apikey-{signal is post_save}",
        )
        signal.connect(
            _model_changed, sender=Model, dispatch_uid=f"racon-cache-model-{signal is post_save}"
        )
        signal.connect(
            _model_changed,
            sender=ModelFile,
            dispatch_uid=f"racon-cache-modelfile-{signal is post_save}",
        )
