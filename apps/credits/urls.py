"""Credits API routes; the project mounts them at "api/credits/"."""

from __future__ import annotations

from django.urls import path

from . import api

urlpatterns = [
    path("balance", api.BalanceApi.as_view(), name="credits-balance"),
    path("ledger", api.LedgerApi.as_view(), name="credits-ledger"),
    path("usage", api.KeyUsageApi.as_view(), name="credits-usage"),
    path("earnings", api.EarningsApi.as_view(), name="credits-earnings"),
    path("receipts", api.ReceiptListApi.as_view(), name="credits-receipts"),
    path("receipts/verify", api.ReceiptVerifyApi.as_view(), name="credits-receipt-verify"),
    path("receipts/<uuid:receipt_id>", api.ReceiptDetailApi.as_view(), name="credits-receipt"),
    path("public-key", api.PublicKeyApi.as_view(), name="credits-public-key"),
    path("admin/grant", api.AdminGrantApi.as_view(), name="credits-admin-grant"),
    path("admin/adjust", api.AdminAdjustApi.as_view(), name="credits-admin-adjust"),
]
