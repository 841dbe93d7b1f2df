"""Credits API (mounted at /api/credits/): balance, ledger, receipts, verification, admin grants."""

from __future__ import annotations

from typing import Any

from django.shortcuts import get_object_or_404
from django.utils import timezone
from django_filters.rest_framework import DjangoFilterBackend
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    OpenApiResponse,
    extend_schema,
    extend_schema_field,
)
from rest_framework import exceptions, serializers, status
from rest_framework.generics import GenericAPIView
from rest_framework.parsers import JSONParser
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from apps.accounts.models import Account, ApiKey
from apps.accounts.permissions import IsAuthenticatedAccount, IsStaff, KeyScope
from apps.accounts.principal import request_account_id
from apps.nodes.api import AgentErrorSerializer
from racon import ids
from racon.filters import filters_checked

from . import ledger, receipts, selectors
from .filters import LedgerFilter, ReceiptFilter
from .models import Posting, Receipt
from .rules import MAX_AMOUNT


class InsufficientCreditsError(exceptions.APIException):
    status_code = status.HTTP_409_CONFLICT
    default_detail = "the account lacks the credits above its floor"
    default_code = "insufficient_credits"


def _is_staff(request: Request, view: Any) -> bool:
    return IsStaff().has_permission(request, view)


def _target_account(request: Request, view: Any, requested: Any) -> Any:
    """The caller's account; staff may name another one."""
    own = request_account_id(request)
    if requested is not None and (own is None or str(requested) != str(own)):
        if not _is_staff(request, view):
            raise exceptions.PermissionDenied("only staff may look at another account")
        return requested
    if own is None:
        raise exceptions.PermissionDenied("this credential has no credit account")
    return own


def _account_param(name: str = "account") -> OpenApiParameter:
    return OpenApiParameter(
        name, OpenApiTypes.UUID, description="account id (staff only; default: yours)"
    )


class AccountOut(serializers.ModelSerializer):
    class Meta:
        model = Account
        fields = ["id", "name", "kind", "balance", "floor", "created_at"]


class BalanceApi(APIView):
    """GET /api/credits/balance — the caller's balance, what is free, held, earned and escrowed."""

    permission_classes = [IsAuthenticatedAccount]

    class FilterIn(serializers.Serializer):
        account = serializers.UUIDField(required=False)

    class BalanceOut(serializers.Serializer):
        account = AccountOut()
        balance = serializers.IntegerField(help_text="micro-credits")
        floor = serializers.IntegerField(allow_null=True)
        available = serializers.IntegerField(
            allow_null=True, help_text="balance above the floor; null when unbounded"
        )
        held = serializers.IntegerField(help_text="reserved for jobs not settled yet")
        earned_total = serializers.IntegerField()
        earned_recent = serializers.IntegerField()
        escrow_held = serializers.IntegerField()
        standing = serializers.IntegerField(
            help_text=(
                "queue priority: what the account earned lending over "
                "CREDITS_STANDING_WINDOW_SECONDS (the balance does not count)"
            )
        )
        priority_seconds = serializers.FloatField(
            help_text="seconds a waiting request of this account is moved ahead for its standing"
        )

    @extend_schema(
        parameters=[_account_param()],
        responses={
            200: BalanceOut,
            404: OpenApiResponse(AgentErrorSerializer, description="no such account"),
        },
    )
    def get(self, request: Request) -> Response:
        # A plain dict: DRF reads an empty value of a QueryDict as absent (?account= would be
        # yours), not as the malformed id it is.
        f = self.FilterIn(data=request.query_params.dict())
        f.is_valid(raise_exception=True)
        account_id = _target_account(request, self, f.validated_data.get("account"))
        get_object_or_404(Account, pk=account_id)
        return Response(
            self.BalanceOut(
                selectors.account_summary(account_id=account_id, now=timezone.now())
            ).data
        )


class KeyUsageApi(APIView):
    """GET /api/credits/usage — per API key of the account: jobs, tokens and credits charged."""

    permission_classes = [IsAuthenticatedAccount, KeyScope]
    key_scopes = {"*": ApiKey.SCOPE_READ}

    class KeyUsageFilterIn(serializers.Serializer):
        account = serializers.UUIDField(required=False)

    class KeyUsageOut(serializers.Serializer):
        key = serializers.UUIDField()
        name = serializers.CharField()
        prefix = serializers.CharField()
        revoked = serializers.BooleanField()
        last_used_at = serializers.DateTimeField(allow_null=True)
        jobs = serializers.IntegerField()
        prompt_tokens = serializers.IntegerField()
        completion_tokens = serializers.IntegerField()
        total_tokens = serializers.IntegerField()
        credits = serializers.IntegerField(help_text="micro-credits charged to the account")

    @extend_schema(parameters=[_account_param()], responses=KeyUsageOut(many=True))
    def get(self, request: Request) -> Response:
        f = self.KeyUsageFilterIn(data=request.query_params.dict())
        f.is_valid(raise_exception=True)
        account_id = _target_account(request, self, f.validated_data.get("account"))
        return Response(
            self.KeyUsageOut(selectors.key_usage(account_id=account_id), many=True).data
        )


class PostingOut(serializers.ModelSerializer):
    entry_id = serializers.IntegerField(source="entry.id")
    kind = serializers.CharField(source="entry.kind")
    memo = serializers.CharField(source="entry.memo")
    key = serializers.CharField(source="entry.idempotency_key")
    job = serializers.UUIDField(source="entry.job_id", allow_null=True)
    node = serializers.UUIDField(source="entry.node_id", allow_null=True)
    created_at = serializers.DateTimeField(source="entry.created_at")

    class Meta:
        model = Posting
        fields = [
            "id",
            "entry_id",
            "kind",
            "key",
            "memo",
            "amount",
            "beneficiary",
            "job",
            "node",
            "created_at",
        ]


class LedgerApi(GenericAPIView):
    """GET /api/credits/ledger?kind=&since=&until=&limit=&offset= — the account's postings, newest first."""

    permission_classes = [IsAuthenticatedAccount]
    queryset = (
        Posting.objects.none()
    )  # names the model for the schema; get() starts from the account's rows
    filter_backends = [DjangoFilterBackend]  # documents LedgerFilter; get() applies it itself
    filterset_class = LedgerFilter

    @extend_schema(responses=PostingOut(many=True))
    def get(self, request: Request) -> Response:
        filters = LedgerFilter(request.query_params, request=request)
        account_id = _target_account(request, self, filters_checked(filters).get("account"))
        qs = filters.filter_queryset(selectors.ledger_postings(account_id=account_id))
        page = self.paginate_queryset(qs)
        return self.get_paginated_response(PostingOut(page, many=True).data)


class ReceiptOut(serializers.ModelSerializer):
    document = serializers.SerializerMethodField(
        help_text="the signed receipt, as POST receipts/verify takes it"
    )

    class Meta:
        model = Receipt
        fields = [
            "id",
            "job",
            "node",
            "account",
            "model_name",
            "tokens",
            "layers",
            "share_ppm",
            "credits",
            "escrowed",
            "is_primary",
            "issued_at",
            "key_id",
            "document",
        ]

    def get_document(self, obj: Receipt) -> dict[str, Any]:
        return obj.document()


class ReceiptListApi(GenericAPIView):
    """GET /api/credits/receipts?job=&node= — receipts of the caller's nodes (staff: all)."""

    permission_classes = [IsAuthenticatedAccount]
    queryset = (
        Receipt.objects.none()
    )  # names the model for the schema; get() starts from the account's rows
    filter_backends = [DjangoFilterBackend]  # documents ReceiptFilter; get() applies it itself
    filterset_class = ReceiptFilter

    @extend_schema(responses=ReceiptOut(many=True))
    def get(self, request: Request) -> Response:
        filters = ReceiptFilter(request.query_params, request=request)
        requested = filters_checked(filters).get("account")
        account_id = (
            requested if _is_staff(request, self) else _target_account(request, self, requested)
        )
        qs = filters.filter_queryset(selectors.receipt_list(account_id=account_id))
        page = self.paginate_queryset(qs)
        return self.get_paginated_response(ReceiptOut(page, many=True).data)


class ReceiptDetailApi(APIView):
    """GET /api/credits/receipts/<id> — one receipt (of the caller's nodes unless staff)."""

    permission_classes = [IsAuthenticatedAccount]

    @extend_schema(responses=ReceiptOut, operation_id="credits_receipt_detail")
    def get(self, request: Request, receipt_id: str) -> Response:
        account_id = None if _is_staff(request, self) else _target_account(request, self, None)
        receipt = get_object_or_404(selectors.receipt_list(account_id=account_id), pk=receipt_id)
        return Response(ReceiptOut(receipt).data)


class ReceiptVerifyApi(APIView):
    """POST /api/credits/receipts/verify {receipt} — does the signature match, with no field altered?"""

    authentication_classes: list[Any] = []  # anyone may check a receipt; it proves nothing secret
    permission_classes = [AllowAny]
    parser_classes = [JSONParser]  # a receipt is a JSON document

    class VerifyIn(serializers.Serializer):
        receipt = serializers.DictField(
            help_text="the receipt document (its fields plus signature)"
        )

    class VerifyOut(serializers.Serializer):
        valid = serializers.BooleanField()
        reason = serializers.CharField()

    @extend_schema(request=VerifyIn, responses=VerifyOut)
    def post(self, request: Request) -> Response:
        data = self.VerifyIn(data=request.data)
        data.is_valid(raise_exception=True)
        result = receipts.receipt_check(receipt=data.validated_data["receipt"])
        return Response(self.VerifyOut({"valid": result.valid, "reason": result.reason}).data)


class PublicKeyApi(APIView):
    """GET /api/credits/public-key — the Ed25519 key receipts are signed with (base64 raw and PEM)."""

    authentication_classes: list[Any] = []
    permission_classes = [AllowAny]

    class KeyOut(serializers.Serializer):
        algorithm = serializers.CharField()
        key_id = serializers.CharField()
        public_key = serializers.CharField(help_text="base64 of the 32 raw bytes")
        pem = serializers.CharField()

    @extend_schema(responses=KeyOut)
    def get(self, request: Request) -> Response:
        return Response(self.KeyOut(receipts.receipt_public_key()).data)


@extend_schema_field(
    {"type": "integer", "minimum": -MAX_AMOUNT, "maximum": MAX_AMOUNT, "not": {"enum": [0]}}
)
class NonZeroAmountField(serializers.IntegerField):
    """Micro-credits within ±2^62, never 0 (the ledger's amount_check)."""

    default_error_messages = {"zero": "must not be zero"}

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(min_value=-MAX_AMOUNT, max_value=MAX_AMOUNT, **kwargs)

    def to_internal_value(self, data: Any) -> int:
        value = super().to_internal_value(data)
        if value == 0:
            self.fail("zero")
        return value


class _AdminMoveApi(APIView):
    permission_classes = [IsStaff]
    allow_negative = False

    class MoveIn(serializers.Serializer):
        """A grant: amount > 0."""

        account = serializers.UUIDField()
        amount = serializers.IntegerField(
            min_value=1, max_value=MAX_AMOUNT, help_text="micro-credits (1 to 2^62)"
        )
        reason = serializers.CharField(max_length=500)
        idempotency_key = serializers.CharField(
            max_length=100, required=False, help_text="repeat-safe: same key, one entry"
        )

    class AdjustIn(MoveIn):
        """An adjustment: amount ≠ 0, negative takes credits back (down to the floor)."""

        amount = NonZeroAmountField(help_text="micro-credits (±2^62, not 0)")

    class EntryOut(serializers.Serializer):
        entry_id = serializers.IntegerField(source="entry.id")
        kind = serializers.CharField(source="entry.kind")
        memo = serializers.CharField(source="entry.memo")
        created_at = serializers.DateTimeField(source="entry.created_at")
        account = AccountOut()

    def _move(self, request: Request) -> Response:
        data = (self.AdjustIn if self.allow_negative else self.MoveIn)(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        account = get_object_or_404(Account, pk=v["account"])
        action = ledger.credit_adjust if self.allow_negative else ledger.credit_grant
        try:
            entry = action(
                account_id=ids.account_id(account.pk),
                amount=v["amount"],
                reason=v["reason"],
                now=timezone.now(),
                key=v.get("idempotency_key"),
            )
        except ledger.InsufficientCredits as exc:
            raise InsufficientCreditsError(str(exc)) from None
        except ValueError as exc:
            raise exceptions.ValidationError({"amount": [str(exc)]}) from None
        account.refresh_from_db()
        return Response(
            self.EntryOut({"entry": entry, "account": account}).data, status=status.HTTP_201_CREATED
        )


class AdminGrantApi(_AdminMoveApi):
    """POST /api/credits/admin/grant {account, amount > 0, reason} — mint credits into an account."""

    @extend_schema(request=_AdminMoveApi.MoveIn, responses={201: _AdminMoveApi.EntryOut})
    def post(self, request: Request) -> Response:
        return self._move(request)


class AdminAdjustApi(_AdminMoveApi):
    """POST /api/credits/admin/adjust {account, amount ≠ 0, reason} — correct a balance (down to its floor)."""

    allow_negative = True

    @extend_schema(request=_AdminMoveApi.AdjustIn, responses={201: _AdminMoveApi.EntryOut})
    def post(self, request: Request) -> Response:
        return self._move(request)


class EarningsApi(APIView):
    """GET /api/credits/earnings?days=30&node= — per node and day: credits earned, jobs served,
    receipts (the caller's nodes)."""

    permission_classes = [IsAuthenticatedAccount]

    class EarningsOut(serializers.Serializer):
        node = serializers.UUIDField()
        node_name = serializers.CharField()
        day = serializers.DateField(help_text="UTC day")
        credits = serializers.IntegerField(help_text="micro-credits earned (ledger)")
        jobs = serializers.IntegerField(help_text="jobs served (with a receipt)")
        receipts = serializers.IntegerField()

    @extend_schema(
        parameters=[
            OpenApiParameter(
                "days",
                {"type": "integer", "minimum": 1, "maximum": 366, "default": 30},
                description="how many days back (1-366, default 30)",
            ),
            OpenApiParameter("node", OpenApiTypes.UUID, description="only this node"),
        ],
        responses=EarningsOut(many=True),
        operation_id="credits_earnings",
    )
    def get(self, request: Request) -> Response:
        raw_days = request.query_params.get("days")
        try:
            days = 30 if raw_days is None else int(raw_days)
        except ValueError:
            raise exceptions.ValidationError({"days": ["must be a whole number"]}) from None
        if not 1 <= days <= 366:
            raise exceptions.ValidationError({"days": ["must be between 1 and 366"]})
        node = request.query_params.get("node")
        node_id = None
        if node is not None:
            try:
                node_id = ids.node_id(node)
            except ValueError:
                raise exceptions.ValidationError({"node": ["must be a node id"]}) from None
        rows = selectors.node_earnings(
            account_id=_target_account(request, self, None), days=days, node_id=node_id
        )
        return Response(self.EarningsOut(rows, many=True).data)
