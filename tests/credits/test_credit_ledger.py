from __future__ import annotations

from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from apps.accounts.models import Account, AccountKind
from apps.credits.ledger import (
    InsufficientCredits,
    account_create,
    account_for_user,
    account_system,
    credit_adjust,
    credit_grant,
    ledger_post,
    ledger_verify,
)
from apps.credits.models import AppendOnlyError, Entry, EntryKind, Posting
from racon import ids
from tests.factories import AccountFactory, UserFactory, funded_account

pytestmark = pytest.mark.django_db


def balances(*accts: Account) -> list[int]:
    return [Account.objects.get(pk=a.pk).balance for a in accts]


def test_ledger_post_writes_a_balanced_entry_and_updates_cached_balances(now: Any) -> None:
    a, b = AccountFactory(), AccountFactory(floor=None)
    entry = ledger_post(
        key="t:1", kind=EntryKind.ADJUST, postings=[(b.pk, -500), (a.pk, 500)], memo="move", now=now
    )
    assert sorted(p.amount for p in entry.postings.all()) == [-500, 500]
    assert balances(a, b) == [500, -500]
    assert ledger_verify().ok


def test_same_key_twice_returns_the_first_entry_and_moves_nothing_more(now: Any) -> None:
    a, b = AccountFactory(), AccountFactory(floor=None)
    first = ledger_post(
        key="t:dup", kind=EntryKind.ADJUST, postings=[(b.pk, -5), (a.pk, 5)], memo="", now=now
    )
    second = ledger_post(
        key="t:dup", kind=EntryKind.ADJUST, postings=[(b.pk, -5), (a.pk, 5)], memo="", now=now
    )
    assert first.pk == second.pk
    assert Entry.objects.filter(idempotency_key="t:dup").count() == 1
    assert balances(a, b) == [5, -5]


def test_a_key_reused_for_another_kind_is_refused(now: Any) -> None:
    a, b = AccountFactory(), AccountFactory(floor=None)
    ledger_post(
        key="t:k", kind=EntryKind.ADJUST, postings=[(b.pk, -5), (a.pk, 5)], memo="", now=now
    )
    with pytest.raises(ValueError, match="already names"):
        ledger_post(
            key="t:k", kind=EntryKind.GRANT, postings=[(b.pk, -5), (a.pk, 5)], memo="", now=now
        )


def test_postings_that_do_not_sum_to_zero_are_refused_and_nothing_is_written(now: Any) -> None:
    a, b = AccountFactory(), AccountFactory(floor=None)
    with pytest.raises(ValueError, match="sum to 1"):
        ledger_post(
            key="t:bad", kind=EntryKind.ADJUST, postings=[(b.pk, -5), (a.pk, 6)], memo="", now=now
        )
    assert not Entry.objects.filter(idempotency_key="t:bad").exists()
    assert balances(a, b) == [0, 0]


@pytest.mark.parametrize("amount", [0, 1.5, True, "10", 2**62 + 1, -(2**62) - 1, 10**30])
def test_zero_fractional_and_overflowing_posting_amounts_are_refused(now: Any, amount: Any) -> None:
    a, b = AccountFactory(), AccountFactory(floor=None)
    with pytest.raises(ValueError):
        ledger_post(
            key="t:amt",
            kind=EntryKind.ADJUST,
            postings=[(b.pk, amount), (a.pk, amount)],
            memo="",
            now=now,
        )
    assert not Entry.objects.exists() and not Posting.objects.exists()


@pytest.mark.parametrize("amount", [0, -1, -(10**6), 2**62 + 1, 1.0])
def test_grants_must_be_positive_integers_within_range(now: Any, amount: Any) -> None:
    acct = AccountFactory()
    with pytest.raises(ValueError):
        credit_grant(account_id=ids.account_id(acct.pk), amount=amount, reason="r", now=now)
    assert balances(acct) == [0]


def test_a_balance_that_would_overflow_is_refused(now: Any) -> None:
    acct = funded_account(2**62)
    with pytest.raises(ValueError, match="overflow"):
        credit_grant(account_id=ids.account_id(acct.pk), amount=1, reason="one more", now=now)
    assert balances(acct) == [2**62]


def test_a_posting_below_the_floor_raises_insufficient_credits_and_writes_nothing(now: Any) -> None:
    acct = funded_account(100)
    sink = AccountFactory(floor=None)
    with pytest.raises(InsufficientCredits) as info:
        ledger_post(
            key="t:floor",
            kind=EntryKind.ADJUST,
            postings=[(acct.pk, -101), (sink.pk, 101)],
            memo="",
            now=now,
        )
    assert info.value.needed == 101 and info.value.available == 100
    assert not Entry.objects.filter(idempotency_key="t:floor").exists()
    assert balances(acct, sink) == [100, 0]


def test_a_custom_floor_allows_overdraft_down_to_it(now: Any) -> None:
    acct = AccountFactory(floor=-50)
    sink = AccountFactory(floor=None)
    ledger_post(
        key="t:od",
        kind=EntryKind.ADJUST,
        postings=[(acct.pk, -50), (sink.pk, 50)],
        memo="",
        now=now,
    )
    with pytest.raises(InsufficientCredits):
        ledger_post(
            key="t:od2",
            kind=EntryKind.ADJUST,
            postings=[(acct.pk, -1), (sink.pk, 1)],
            memo="",
            now=now,
        )
    assert balances(acct) == [-50]


def test_the_mint_is_unbounded_and_grants_carry_their_reason(now: Any) -> None:
    acct = AccountFactory()
    entry = credit_grant(
        account_id=ids.account_id(acct.pk), amount=10**9, reason="welcome bonus", now=now
    )
    assert entry.memo == "welcome bonus" and entry.kind == EntryKind.GRANT
    assert account_system(name="system:mint").balance == -(10**9)
    assert balances(acct) == [10**9]


def test_negative_adjust_goes_down_to_the_floor_but_not_below(now: Any) -> None:
    acct = funded_account(1_000)
    credit_adjust(
        account_id=ids.account_id(acct.pk), amount=-600, reason="refund reversal", now=now
    )
    with pytest.raises(InsufficientCredits):
        credit_adjust(account_id=ids.account_id(acct.pk), amount=-401, reason="too much", now=now)
    credit_adjust(account_id=ids.account_id(acct.pk), amount=-400, reason="to zero", now=now)
    assert balances(acct) == [0]
    with pytest.raises(ValueError, match="reason"):
        credit_adjust(account_id=ids.account_id(acct.pk), amount=5, reason="  ", now=now)


def test_ledger_rows_are_append_only(now: Any) -> None:
    acct = funded_account(10)
    entry = Entry.objects.get(postings__account=acct)
    posting = entry.postings.first()
    assert posting is not None
    with pytest.raises(AppendOnlyError):
        entry.memo = "rewritten"
        entry.save()
    with pytest.raises(AppendOnlyError):
        posting.delete()
    with pytest.raises(AppendOnlyError):
        Posting.objects.filter(pk=posting.pk).update(amount=99)
    with pytest.raises(AppendOnlyError):
        Entry.objects.all().delete()


def test_new_accounts_get_the_starting_grant_minted_once(settings: Any) -> None:
    settings.CREDITS_STARTING_GRANT = 7_000
    acct = account_create(name="org:acme", kind=AccountKind.ORG)
    assert acct.balance == 7_000
    user = UserFactory()
    ua = account_for_user(user=user)
    assert ua.balance == 7_000 and account_for_user(user=user).pk == ua.pk
    assert Entry.objects.filter(kind=EntryKind.GRANT, memo="starting grant").count() == 2
    assert ledger_verify().total_minted == 14_000


def test_no_starting_grant_when_the_setting_is_zero(settings: Any) -> None:
    settings.CREDITS_STARTING_GRANT = 0
    assert account_create(name="user:zero").balance == 0
    assert not Entry.objects.exists()


def test_system_accounts_are_unbounded_except_holds_and_escrow() -> None:
    assert account_system(name="system:operator").floor is None
    assert account_system(name="system:mint").floor is None
    assert account_system(name="system:holds").floor == 0
    assert account_system(name="system:escrow").floor == 0


def test_credits_check_passes_on_a_sound_ledger_and_fails_on_a_tampered_cache(
    now: Any, capsys: Any
) -> None:
    acct = funded_account(1_000)
    call_command("credits_check")
    assert "ledger OK" in capsys.readouterr().out
    Account.objects.filter(pk=acct.pk).update(balance=5_000)  # a cache written outside the ledger
    with pytest.raises(CommandError):
        call_command("credits_check")
    err = capsys.readouterr().err
    assert "MISMATCH" in err and "5000" in err


def test_ledger_verify_reports_an_entry_that_does_not_sum_to_zero(now: Any) -> None:
    acct = AccountFactory()
    entry = Entry.objects.create(
        idempotency_key="t:raw", kind=EntryKind.ADJUST, created_at=timezone.now()
    )
    Posting.objects.create(entry=entry, account=acct, amount=3)  # bypasses ledger_post on purpose
    report = ledger_verify()
    assert not report.ok
    assert report.unbalanced_entries == [{"entry_id": entry.pk, "sum": 3}]
