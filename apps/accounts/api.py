"""REST for contributor accounts (operators: /api/admin/accounts) and API keys (each user's own:
/api/keys). Per-key usage is a credits read, /api/credits/usage (apps.credits.api)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.password_validation import password_validators_help_texts
from django.core.exceptions import ValidationError as DjangoValidationError
from django.shortcuts import get_object_or_404
from django.utils import timezone
from drf_spectacular.extensions import OpenApiSerializerExtension
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import exceptions, serializers
from rest_framework.parsers import JSONParser
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from racon import ids
from racon.ids import AccountId, ApiKeyId

from . import selectors, services
from .models import Account, ApiKey
from .permissions import IsAuthenticatedAccount, IsStaff, KeyScope
from .principal import request_principal, user_account


def invite_url(invite: str) -> str:
    return f"{settings.CONTROLLER_PUBLIC_URL.rstrip('/')}/invite/{invite}/"


def _bad_request(exc: Exception) -> exceptions.ValidationError:
    messages = exc.messages if isinstance(exc, DjangoValidationError) else [str(exc)]
    return exceptions.ValidationError({"non_field_errors": messages})


# --- accounts (operators) -------------------------------------------------------------------------


class ContributorAccountOut(serializers.ModelSerializer):
    username = serializers.CharField(source="user.username", default=None, allow_null=True)
    email = serializers.CharField(source="user.email", default=None, allow_null=True)
    is_staff = serializers.BooleanField(source="user.is_staff", default=False)
    invite_pending = serializers.SerializerMethodField()
    active_keys = serializers.IntegerField(read_only=True, default=0)

    class Meta:
        model = Account
        fields = [
            "id",
            "name",
            "kind",
            "balance",
            "username",
            "email",
            "is_staff",
            "invite_pending",
            "active_keys",
            "created_at",
        ]

    def get_invite_pending(self, obj: Account) -> bool:
        """True while the user has not set a password (an invite is outstanding)."""
        return obj.user is not None and not obj.user.has_usable_password()


class AccountListCreateApi(APIView):
    """GET: contributor accounts. POST: create one with a password, or invite (no password: the
    answer carries a one-time link to set it). The starting grant is posted either way."""

    permission_classes = [IsStaff]

    class AccountCreateIn(serializers.Serializer):
        username = serializers.RegexField(r"^[\w.@+-]{1,150}$")
        email = serializers.EmailField(required=False, default="", allow_blank=True)
        # Taken as sent (no trimming): a password's spaces are part of it. Absent or blank: an
        # invite. Else AUTH_PASSWORD_VALIDATORS' rules (AccountCreateInSchema states them).
        password = serializers.CharField(
            required=False, allow_blank=True, trim_whitespace=False, write_only=True
        )
        is_staff = serializers.BooleanField(default=False)

    class AccountCreatedOut(ContributorAccountOut):
        invite_url = serializers.CharField(allow_null=True)

        class Meta(ContributorAccountOut.Meta):
            fields = [*ContributorAccountOut.Meta.fields, "invite_url"]

    @extend_schema(responses=ContributorAccountOut(many=True))
    def get(self, request: Request) -> Response:
        return Response(ContributorAccountOut(selectors.account_list()[:1000], many=True).data)

    @extend_schema(
        request=AccountCreateIn,
        responses={201: AccountCreatedOut},
        description=(
            "Create a contributor account with a password, or invite one (no password: the "
            "answer carries a one-time link to set it). A username in use already is a 409 "
            "with `error.code` `username_taken` and `error.fields.username`; a password the "
            "password rules refuse is a 400 naming `password`."
        ),
    )
    def post(self, request: Request) -> Response:
        data = self.AccountCreateIn(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        try:
            created = services.account_user_create(
                username=v["username"],
                email=v["email"],
                password=v.get("password") or None,
                is_staff=v["is_staff"],
            )
        except services.UsernameTaken as exc:
            return Response(
                {
                    "error": {
                        "message": str(exc),
                        "code": exc.code,
                        "fields": {exc.field: [str(exc)]},
                    }
                },
                status=409,
            )
        except DjangoValidationError as exc:  # validate_password: the password's rules
            raise exceptions.ValidationError({"password": exc.messages}) from exc
        except ValueError as exc:
            raise _bad_request(exc) from exc
        out = dict(ContributorAccountOut(created.account).data)
        out["invite_url"] = invite_url(created.invite) if created.invite else None
        return Response(out, status=201)


class AccountCreateInSchema(OpenApiSerializerExtension):
    """AccountCreateIn's password rules, which the field alone cannot state: blank (an invite) or
    at least AUTH_PASSWORD_VALIDATORS' minimum length, and every configured rule in words."""

    target_class = AccountListCreateApi.AccountCreateIn

    def map_serializer(self, auto_schema: Any, direction: Any) -> dict[str, Any]:
        schema: dict[str, Any] = auto_schema._map_serializer(
            self.target, direction, bypass_extensions=True
        )
        if direction == "request":
            password = schema["properties"]["password"]
            minimum = services.password_min_length()
            if minimum > 0:  # drf-spectacular says blank as a oneOf branch {maxLength: 0}
                for branch in password.get("oneOf", [password]):
                    if branch.get("maxLength") != 0:
                        branch["minLength"] = minimum
            rules = " ".join(password_validators_help_texts())
            password["description"] = (
                "absent or blank: the answer carries a one-time invite link instead. "
                f"Else the password rules: {rules or 'none configured.'}"
            )
        return schema


class AccountInviteApi(APIView):
    """POST: a new one-time set-password link for an account's user who has not set one yet."""

    permission_classes = [IsStaff]

    class InviteOut(serializers.Serializer):
        account = serializers.UUIDField()
        username = serializers.CharField()
        invite_url = serializers.CharField()

    @extend_schema(request=None, responses=InviteOut)
    def post(self, request: Request, account_id: AccountId) -> Response:
        account = get_object_or_404(Account.objects.select_related("user"), pk=account_id)
        if account.user is None:
            raise exceptions.ValidationError(
                {"non_field_errors": ["this account has no user to invite"]}
            )
        if account.user.has_usable_password():
            raise exceptions.ValidationError(
                {"detail": ["this user has set a password already; an invite would reset it"]}
            )
        invite = services.invite_issue(user=account.user)
        return Response(
            {
                "account": account.id,
                "username": account.user.username,
                "invite_url": invite_url(invite),
            }
        )


class InviteAcceptApi(APIView):
    """POST the invite's uid and token with a new password (no sign-in: the token is the proof)."""

    authentication_classes: list[Any] = []
    permission_classes = [AllowAny]

    class InviteAcceptIn(serializers.Serializer):
        uid = serializers.CharField()
        token = serializers.CharField()
        password = serializers.CharField(write_only=True)

    class InviteAcceptOut(serializers.Serializer):
        username = serializers.CharField()

    @extend_schema(request=InviteAcceptIn, responses=InviteAcceptOut)
    def post(self, request: Request) -> Response:
        data = self.InviteAcceptIn(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        try:
            user = services.invite_accept(uidb64=v["uid"], token=v["token"], password=v["password"])
        except services.InviteInvalid as exc:
            raise exceptions.NotFound(str(exc)) from exc
        except DjangoValidationError as exc:
            raise _bad_request(exc) from exc
        return Response({"username": user.username})


# --- API keys (each user's own) -------------------------------------------------------------------


class ApiKeyOut(serializers.ModelSerializer):
    status = serializers.SerializerMethodField()
    account_name = serializers.CharField(source="account.name", read_only=True)

    class Meta:
        model = ApiKey
        fields = [
            "id",
            "name",
            "prefix",
            "scopes",
            "status",
            "account",
            "account_name",
            "created_at",
            "expires_at",
            "last_used_at",
            "revoked_at",
            "parent",
            "requests_per_minute",
            "tokens_per_minute",
            "max_concurrent",
        ]

    def get_status(self, obj: ApiKey) -> str:
        """active, expired or revoked."""
        return selectors.key_status(obj, now=timezone.now())


def caller_account_id(request: Request, requested: Any = None) -> Any:
    """The caller's own account (the key's, or the session user's); staff may name another."""
    principal = request_principal(request)
    if requested is not None:
        if not IsStaff().has_permission(request, None):
            own = principal.account_id if principal else user_account(user=request.user).id
            if str(requested) != str(own):
                raise exceptions.PermissionDenied("only staff may manage another account's keys")
        return requested
    if principal is not None:
        return principal.account_id
    return user_account(user=request.user).id


class KeyListCreateApi(APIView):
    """GET: your keys (never their secrets) with when each was last used. POST: a new key, whose
    secret is in this one answer only. A key needs the `read` scope to list and `keys` to create,
    and cannot create a key with scopes it lacks itself."""

    permission_classes = [IsAuthenticatedAccount, KeyScope]
    key_scopes = {"GET": ApiKey.SCOPE_READ, "*": ApiKey.SCOPE_KEYS}
    parser_classes = [JSONParser]  # expires_at may be null, which form data cannot carry

    class KeyFilterIn(serializers.Serializer):
        account = serializers.UUIDField(required=False)
        # A choice, not a BooleanField: that one reads an empty value as false instead of refusing it.
        all = serializers.ChoiceField(choices=["true", "false"], default="false")

    class KeyCreateIn(serializers.Serializer):
        name = serializers.CharField(max_length=120)
        scopes = serializers.ListField(
            child=serializers.ChoiceField(choices=list(ApiKey.SCOPES)),
            default=[ApiKey.SCOPE_INFERENCE],
            allow_empty=False,
        )
        expires_at = serializers.DateTimeField(
            required=False,
            allow_null=True,
            help_text=(
                "a moment in the future, up to 9999-12-31T23:59:59Z (a past one is a 400); "
                "null or absent: never"
            ),
        )
        expires_in_days = serializers.IntegerField(
            required=False, min_value=1, max_value=3650, help_text="instead of expires_at"
        )
        account = serializers.UUIDField(required=False, help_text="staff only; default: yours")

        def validate_expires_at(self, value: Any) -> Any:
            if value is not None and value <= timezone.now():
                raise serializers.ValidationError("must be in the future")
            return value

        def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
            if "expires_at" in attrs and "expires_in_days" in attrs:
                raise serializers.ValidationError(
                    {"expires_in_days": ["give expires_at or expires_in_days, not both"]}
                )
            return attrs

    class KeyCreatedOut(ApiKeyOut):
        key = serializers.CharField(help_text="the secret: shown in this answer only")

        class Meta(ApiKeyOut.Meta):
            fields = [*ApiKeyOut.Meta.fields, "key"]

    @extend_schema(
        parameters=[
            OpenApiParameter("account", OpenApiTypes.UUID, description="account id (staff only)"),
            OpenApiParameter(
                "all", str, enum=["true", "false"], description="include revoked keys"
            ),
        ],
        responses=ApiKeyOut(many=True),
    )
    def get(self, request: Request) -> Response:
        # A plain dict: DRF reads an empty query value of a QueryDict as absent, not as invalid.
        f = self.KeyFilterIn(data=request.query_params.dict())
        f.is_valid(raise_exception=True)
        account_id = caller_account_id(request, f.validated_data.get("account"))
        keys = selectors.key_list(
            account_id=account_id, include_revoked=f.validated_data["all"] == "true"
        )
        return Response(ApiKeyOut(keys.select_related("account")[:1000], many=True).data)

    @extend_schema(
        request=KeyCreateIn,
        responses={
            201: KeyCreatedOut,
            415: OpenApiResponse(description="the body is not JSON (application/json only)"),
        },
    )
    def post(self, request: Request) -> Response:
        data = self.KeyCreateIn(data=request.data)
        data.is_valid(raise_exception=True)
        v = data.validated_data
        now = timezone.now()
        scopes = sorted(set(v["scopes"]))
        principal = request_principal(request)
        staff = IsStaff().has_permission(request, self)
        if principal is not None and not staff and not set(scopes) <= principal.scopes:
            raise exceptions.PermissionDenied("a key cannot create a key with scopes it lacks")
        if ApiKey.SCOPE_ADMIN in scopes and not staff:
            raise exceptions.PermissionDenied("only operators may create admin-scoped keys")
        account_id = caller_account_id(request, v.get("account"))
        account = get_object_or_404(Account, pk=account_id)
        if v.get("account") is not None:
            user_id = account.user_id  # made by an operator for that account's user
        elif principal is not None:
            user_id = getattr(principal.user, "pk", None)
        else:
            user_id = request.user.pk
        expires_at = v.get("expires_at")
        if v.get("expires_in_days"):
            expires_at = now + timedelta(days=v["expires_in_days"])
        # A key made with a key is that key's child: it expires no later (a `keys`-scope key
        # cannot mint a never-expiring one) and is revoked with it.
        parent_id = principal.key_id if principal is not None else None
        try:
            key, plaintext = services.key_create(
                name=v["name"],
                account_id=ids.account_id(account.pk),
                scopes=scopes,
                user_id=user_id,
                expires_at=expires_at,
                now=now,
                parent_id=parent_id,
            )
        except ValueError as exc:
            raise _bad_request(exc) from exc
        out = dict(ApiKeyOut(key).data)
        out["key"] = plaintext
        return Response(out, status=201)


class KeyCreateInSchema(OpenApiSerializerExtension):
    """KeyCreateIn's rules the fields alone do not state: expires_at or expires_in_days, not both;
    at least one scope (allow_empty=False)."""

    target_class = KeyListCreateApi.KeyCreateIn

    def map_serializer(self, auto_schema: Any, direction: Any) -> dict[str, Any]:
        schema: dict[str, Any] = auto_schema._map_serializer(
            self.target, direction, bypass_extensions=True
        )
        if direction == "request":
            schema["not"] = {"required": ["expires_at", "expires_in_days"]}
            schema["properties"]["scopes"]["minItems"] = 1
        return schema


class KeyRevokeApi(APIView):
    """POST: revoke one of your keys (staff: any key). Every process refuses it within moments."""

    permission_classes = [IsAuthenticatedAccount, KeyScope]
    key_scopes = {"*": ApiKey.SCOPE_KEYS}

    @extend_schema(request=None, responses=ApiKeyOut)
    def post(self, request: Request, key_id: ApiKeyId) -> Response:
        staff = IsStaff().has_permission(request, self)
        try:
            selectors.key_get(
                key_id=key_id, account_id=None if staff else caller_account_id(request)
            )
        except ApiKey.DoesNotExist as exc:
            raise exceptions.NotFound("no such key") from exc
        return Response(ApiKeyOut(services.key_revoke(key_id=key_id, now=timezone.now())).data)


# --- limits (operators) ---------------------------------------------------------------------------


class LimitsIn(serializers.Serializer):
    """A key's or an account's limits on /v1; a field left out stays, null takes the setting's
    default (RATE_KEY_* / RATE_ACCOUNT_*), 0 is no limit."""

    requests_per_minute = serializers.IntegerField(
        required=False, allow_null=True, min_value=0, max_value=10**9
    )
    tokens_per_minute = serializers.IntegerField(
        required=False, allow_null=True, min_value=0, max_value=2 * 10**9
    )
    max_concurrent = serializers.IntegerField(
        required=False, allow_null=True, min_value=0, max_value=10**6
    )


class LimitsOut(serializers.Serializer):
    requests_per_minute = serializers.IntegerField(allow_null=True)
    tokens_per_minute = serializers.IntegerField(allow_null=True)
    max_concurrent = serializers.IntegerField(allow_null=True)
    effective = serializers.DictField(
        child=serializers.IntegerField(),
        help_text="what applies now: the own figure, else the setting's default (0: no limit)",
    )


LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent")


def _limits_out(obj: Account | ApiKey, defaults: dict[str, int]) -> dict[str, Any]:
    own = {f: getattr(obj, f) for f in LIMIT_FIELDS}
    return {
        **own,
        "effective": {f: (defaults[f] if own[f] is None else own[f]) for f in LIMIT_FIELDS},
    }


def key_limit_defaults() -> dict[str, int]:
    return {
        "requests_per_minute": settings.RATE_KEY_REQUESTS_PER_MINUTE,
        "tokens_per_minute": settings.RATE_KEY_TOKENS_PER_MINUTE,
        "max_concurrent": settings.RATE_KEY_MAX_CONCURRENT,
    }


def account_limit_defaults() -> dict[str, int]:
    return {
        "requests_per_minute": settings.RATE_ACCOUNT_REQUESTS_PER_MINUTE,
        "tokens_per_minute": settings.RATE_ACCOUNT_TOKENS_PER_MINUTE,
        "max_concurrent": settings.RATE_ACCOUNT_MAX_CONCURRENT,
    }


class KeyLimitsApi(APIView):
    """GET: a key's limits on /v1 (its own figures and what applies). POST: set them (operators).
    Every process applies a change within moments (the key cache is cleared)."""

    permission_classes = [IsStaff]

    @extend_schema(responses=LimitsOut)
    def get(self, request: Request, key_id: ApiKeyId) -> Response:
        key = get_object_or_404(ApiKey, pk=key_id)
        return Response(_limits_out(key, key_limit_defaults()))

    @extend_schema(request=LimitsIn, responses=LimitsOut)
    def post(self, request: Request, key_id: ApiKeyId) -> Response:
        key = get_object_or_404(ApiKey, pk=key_id)
        data = LimitsIn(data=request.data)
        data.is_valid(raise_exception=True)
        services.limits_set(obj=key, limits=dict(data.validated_data))
        return Response(_limits_out(key, key_limit_defaults()))


class AccountLimitsApi(APIView):
    """GET: an account's limits on /v1 over all its keys. POST: set them (operators)."""

    permission_classes = [IsStaff]

    @extend_schema(responses=LimitsOut)
    def get(self, request: Request, account_id: AccountId) -> Response:
        account = get_object_or_404(Account, pk=account_id)
        return Response(_limits_out(account, account_limit_defaults()))

    @extend_schema(request=LimitsIn, responses=LimitsOut)
    def post(self, request: Request, account_id: AccountId) -> Response:
        account = get_object_or_404(Account, pk=account_id)
        data = LimitsIn(data=request.data)
        data.is_valid(raise_exception=True)
        services.limits_set(obj=account, limits=dict(data.validated_data))
        return Response(_limits_out(account, account_limit_defaults()))
