from __future__ import annotations

from django.apps import AppConfig


class CreditsConfig(AppConfig):
    name = "apps.credits"
    label = "credits"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Imported here, not at the top: these modules import models, which load only once the
        # app registry is ready (Django's AppConfig.ready idiom). Loading the tasks registers
        # them, so a task sent by name (racon.celery.task_send) runs eagerly under ALWAYS_EAGER.
        from apps.accounts import principal  # noqa: PLC0415

        from . import tasks  # noqa: F401, PLC0415
        from .ledger import account_for_user  # noqa: PLC0415

        # A signed-in user's account is created with its starting grant: accounts sit below the
        # ledger, so the ledger hands accounts this function instead of being imported by it.
        principal.user_account_provide(account_for_user)
