from __future__ import annotations

import base64
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from apps.credits import signing
from apps.credits.models import Receipt
from apps.credits.receipts import receipt_check, receipt_public_key, receipt_signing_key
from apps.credits.settlement import credit_reserve, credit_settle_job
from racon import ids
from tests.factories import (
    ModelFactory,
    NodeFactory,
    deployment_for,
    funded_account,
    job_finish,
    job_for,
)


@pytest.fixture
def receipt(db: Any, price: Any, now: Any) -> dict[str, Any]:
    nodes = [NodeFactory(), NodeFactory()]
    model = ModelFactory(name="qwen-7b")
    dep = deployment_for([(nodes[0], 20), (nodes[1], 8)], model=model)
    consumer = funded_account(10**6)
    job = job_for(account=consumer, model=model, deployment=dep, max_tokens=64)
    credit_reserve(
        account_id=ids.account_id(consumer.pk),
        job_id=ids.job_id(job.pk),
        max_tokens=64,
        model_price_permille=1000,
        now=now,
    )
    job_finish(
        job, prompt=7, completion=33, device_seconds={str(nodes[0].pk): 0.5, str(nodes[1].pk): 1.25}
    )
    credit_settle_job(job_id=ids.job_id(job.pk), now=now)
    return Receipt.objects.get(job=job, node=nodes[1]).document()


def test_a_settlement_receipt_carries_job_node_model_tokens_layers_share_credits_and_time(
    receipt: dict[str, Any],
) -> None:
    for key in (
        "job_id",
        "node_id",
        "model",
        "tokens",
        "layers",
        "share_ppm",
        "credits",
        "issued_at",
        "signature",
    ):
        assert key in receipt
    assert receipt["model"] == "qwen-7b" and receipt["tokens"] == 40 and receipt["layers"] == 8
    assert receipt["device_ms"] == 1250 and receipt["primary"] is False


def test_an_untouched_receipt_verifies_offline_with_only_the_public_key(
    receipt: dict[str, Any],
) -> None:
    pem = receipt_public_key()["pem"]
    assert signing.receipt_verify(receipt, pem) == signing.VerifyResult(True, "ok")
    assert receipt_check(receipt=receipt).valid


@pytest.mark.parametrize(
    "field,value",
    [
        ("credits", 10**9),
        ("tokens", 41),
        ("layers", 9),
        ("share_ppm", 999_999),
        ("node_id", "someone-else"),
        ("model", "gpt-4"),
        ("issued_at", "2020-01-01T00:00:00+00:00"),
        ("escrowed", True),
        ("extra", 1),
    ],
)
def test_a_receipt_with_any_field_tampered_fails(
    receipt: dict[str, Any], field: str, value: Any
) -> None:
    tampered = {**receipt, field: value}
    result = receipt_check(receipt=tampered)
    assert not result.valid and "does not match" in result.reason


def test_a_removed_field_a_forged_signature_or_another_key_fails(receipt: dict[str, Any]) -> None:
    assert not receipt_check(receipt={k: v for k, v in receipt.items() if k != "credits"}).valid
    assert receipt_check(
        receipt={**receipt, "signature": base64.b64encode(b"x" * 64).decode()}
    ).reason.startswith("signature does not")
    assert (
        receipt_check(receipt={**receipt, "signature": "%%%"}).reason == "signature is not base64"
    )
    assert (
        receipt_check(receipt={k: v for k, v in receipt.items() if k != "signature"}).reason
        == "missing signature"
    )
    other = signing.private_key_generate()
    assert not signing.receipt_verify(receipt, other.public_key()).valid


def test_canonical_json_is_sorted_compact_and_refuses_floats() -> None:
    assert (
        signing.canonical_json({"b": 1, "a": [True, None, "é"]})
        == '{"a":[true,null,"é"],"b":1}'.encode()
    )
    with pytest.raises(ValueError):
        signing.canonical_json({"a": 1.5})


def test_the_signing_key_file_is_created_once_with_mode_0600(settings: Any, tmp_path: Path) -> None:
    path = tmp_path / "keys" / "receipt-signing.key"
    settings.CREDITS_RECEIPT_KEY_PATH = path
    key = receipt_signing_key()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert (
        signing.private_key_from_b64(path.read_text()).private_bytes_raw()
        == key.private_bytes_raw()
    )
    assert [p.name for p in path.parent.iterdir()] == [
        "receipt-signing.key"
    ]  # no temp file left behind


def test_the_default_key_lives_in_var_dir(settings: Any, tmp_path: Path) -> None:
    settings.CREDITS_RECEIPT_KEY_PATH = None
    settings.VAR_DIR = tmp_path
    receipt_signing_key()
    assert (tmp_path / "receipt-signing.key").exists()


def test_racon_receipt_key_from_the_environment_takes_precedence(settings: Any) -> None:
    key = signing.private_key_generate()
    settings.RACON_RECEIPT_KEY = signing.private_key_to_b64(key)
    assert (
        receipt_public_key()["public_key"] == base64.b64encode(signing.public_key_raw(key)).decode()
    )
    assert not Path(settings.CREDITS_RECEIPT_KEY_PATH).exists()


def test_the_verification_module_imports_without_django() -> None:
    code = (
        "import sys, apps.credits.signing; assert 'django' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2]
    )
