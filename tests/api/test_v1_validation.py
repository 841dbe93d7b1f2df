"""The /v1 boundary: every error in OpenAI's exact format, and no job left behind."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from apps.jobs.models import Job
from apps.jobs.states import JobState
from apps.models_repo.models import Model, ModelFile
from tests.support.openai_api import AUTH, assert_openai_error, post

pytestmark = pytest.mark.django_db


def test_missing_key_is_401_invalid_api_key(client: Client) -> None:
    assert_openai_error(
        post(client, {"model": "m", "messages": []}, headers={}), 401, "invalid_api_key"
    )


def test_wrong_key_is_401_invalid_api_key(client: Client) -> None:
    assert_openai_error(
        post(client, {"model": "m", "messages": []}, headers={"Authorization": "Bearer nope"}),
        401,
        "invalid_api_key",
    )


def test_malformed_json_is_400(client: Client) -> None:
    resp = client.post(
        "/v1/chat/completions", "{bad", content_type="application/json", headers=AUTH
    )
    assert_openai_error(resp, 400, "invalid_json")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m"}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}]}, "model"),
        ({"model": "m", "messages": [{"role": "wizard", "content": "hi"}]}, "messages[0]"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0]"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
            "temperature",
        ),
        (
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
            "max_tokens",
        ),
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stop": [1, 2]}, "stop"),
    ],
)
def test_invalid_fields_get_400_naming_the_param(
    client: Client, body: dict[str, Any], param: str
) -> None:
    err = assert_openai_error(post(client, body), 400, "invalid_value", param)
    assert param.split("[")[0] in err["message"]
    assert not Job.objects.exists()


def test_n_above_one_says_it_is_not_supported(client: Client) -> None:
    err = assert_openai_error(
        post(client, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 3}),
        400,
        "invalid_value",
        "n",
    )
    assert "not supported" in err["message"]


def test_unknown_model_is_404_model_not_found(client: Client) -> None:
    err = assert_openai_error(
        post(client, {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}),
        404,
        "model_not_found",
        "model",
    )
    assert "nope" in err["message"]
    assert not Job.objects.exists()


def test_text_part_content_is_accepted_by_validation(client: Client) -> None:
    # Validation passes (text parts are joined); the unknown model is what stops it.
    body = {
        "model": "nope",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    }
    assert_openai_error(post(client, body), 404, "model_not_found")


def test_models_list_is_openai_list_format(client: Client) -> None:
    m = Model.objects.create(name="tiny")
    ModelFile.objects.create(model=m, file_name="t.gguf", sha256="a" * 64, size=1)
    resp = client.get("/v1/models", headers=AUTH)
    assert resp.status_code == 200
    body = resp.json()
    assert body["object"] == "list"
    assert body["data"] == [
        {
            "id": "tiny",
            "object": "model",
            "created": body["data"][0]["created"],
            "owned_by": "racon",
        }
    ]
    assert client.get("/v1/models/tiny", headers=AUTH).json()["id"] == "tiny"
    assert_openai_error(client.get("/v1/models/other", headers=AUTH), 404, "model_not_found")
    assert_openai_error(client.get("/v1/models"), 401, "invalid_api_key")


def test_no_failed_request_leaves_a_job_in_a_non_terminal_state(client: Client) -> None:
    for body in (
        {"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
        {"model": "x", "messages": []},
    ):
        post(client, body)
    assert not Job.objects.exclude(
        state__in=[JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED]
    ).exists()
