"""The agent's checks of a vLLM plan and of a model directory (issue 30); no engine needed."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from agent.models import ShaCache, model_dir_digest
from agent.runtime.primary import PlanError, validate_plan_shape
from agent.runtime.vllm import engine_env, server_args


def _plan(**kw: Any) -> dict[str, Any]:
    plan: dict[str, Any] = {
        "deployment_id": "d1",
        "model_name": "smollm2",
        "sha256": "a" * 64,
        "rpc_endpoints": [],
        "tensor_split": [],
        "n_gpu_layers": -1,
        "n_ctx": 1024,
        "n_parallel": 4,
        "n_threads": 1,
        "engine": "vllm",
        "model_path": "smollm2-dir",
    }
    plan.update(kw)
    return plan


def test_vllm_plan_shape() -> None:
    assert validate_plan_shape(_plan())["engine"] == "vllm"
    with pytest.raises(PlanError, match="'engine' must be"):
        validate_plan_shape(_plan(engine="tgi"))
    with pytest.raises(PlanError, match="one node"):
        validate_plan_shape(_plan(rpc_endpoints=["10.0.0.2:50052"], tensor_split=[1.0]))
    with pytest.raises(PlanError, match="model directory"):
        validate_plan_shape({k: v for k, v in _plan().items() if k != "model_path"})
    with pytest.raises(PlanError, match="kv_bytes"):
        validate_plan_shape(_plan(kv_bytes=-1))


def test_engine_command_line_and_environment() -> None:
    plan: Any = _plan(kv_bytes=3 * 2**30, n_threads=2)
    args = server_args(plan, Path("/m"), 4321)
    assert args[:2] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert args[args.index("--host") + 1] == "127.0.0.1"
    assert args[args.index("--max-num-seqs") + 1] == "4"
    assert "--enforce-eager" in args
    env = engine_env(plan, "secret-key")
    assert "secret-key" not in " ".join(args)  # the key travels in the environment only
    assert env["VLLM_API_KEY"] == "secret-key"
    assert env["OMP_NUM_THREADS"] == "2"
    assert len(env["VLLM_CPU_OMP_THREADS_BIND"].split(",")) <= 2
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_HOST_IP"] == "127.0.0.1"


def _write_dir(d: Path) -> str:
    d.mkdir()
    files = {"config.json": b"{}", "model.safetensors": b"weights"}
    for name, data in files.items():
        (d / name).write_bytes(data)
    lines = "".join(
        f"{hashlib.sha256(data).hexdigest()}  {name}\n" for name, data in sorted(files.items())
    )
    (d / "SHA256SUMS").write_text(lines)
    return hashlib.sha256(lines.encode()).hexdigest()


def test_model_dir_digest_checks_every_file(tmp_path: Path) -> None:
    d = tmp_path / "m"
    want = _write_dir(d)
    cache = ShaCache(tmp_path)
    assert model_dir_digest(d, cache) == want
    (d / "model.safetensors").write_bytes(b"tampered")
    with pytest.raises(ValueError, match=r"model\.safetensors: sha256 .* the manifest says"):
        model_dir_digest(d, cache)
    (d / "model.safetensors").write_bytes(b"weights")
    (d / "extra.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="files not in SHA256SUMS"):
        model_dir_digest(d, cache)
    (d / "extra.bin").unlink()
    (d / "SHA256SUMS").unlink()
    with pytest.raises(ValueError, match="no readable SHA256SUMS"):
        model_dir_digest(d, cache)


def test_kv_blocks_from_events_say_how_much_of_a_sequence_is_cached() -> None:
    from agent.runtime.vllm import KvBlocks

    kv = KvBlocks()
    seq = list(range(100, 140))  # 40 tokens: two whole blocks of 16, and 8 more
    assert kv.cached_tokens(seq) == 0  # no event yet
    kv.apply([{"t": "s", "h": ["a", "b"], "p": None, "ids": seq[:32], "bs": 16}])
    assert kv.cached_tokens(seq) == 32 and kv.cached_tokens(seq[:20]) == 16
    assert kv.cached_tokens([1, *seq[1:]]) == 0  # another first block: nothing in common
    kv.apply([{"t": "r", "h": ["b"]}])  # the second block evicted
    assert kv.cached_tokens(seq) == 16
    kv.apply([{"t": "c"}])
    assert kv.cached_tokens(seq) == 0


def test_the_engine_is_told_to_publish_kv_events_to_loopback_only() -> None:
    import json

    args = server_args(validate_plan_shape(_plan()), Path("/m"), 4321, "tcp://127.0.0.1:5999")
    config = json.loads(args[args.index("--kv-events-config") + 1])
    assert config["endpoint"] == "tcp://127.0.0.1:5999" and config["publisher"] == "zmq"
    assert "--kv-events-config" not in server_args(validate_plan_shape(_plan()), Path("/m"), 4321)


def test_a_model_directory_linked_into_the_models_dir_is_offered(tmp_path: Path) -> None:
    from agent.models import OutsideModelsDir, confined_model_path

    models, elsewhere = tmp_path / "models", tmp_path / "cache" / "smol-st"
    models.mkdir()
    elsewhere.mkdir(parents=True)
    with pytest.raises(OutsideModelsDir):
        confined_model_path(models, str(elsewhere))  # not offered
    (models / "smol-st").symlink_to(elsewhere)
    assert confined_model_path(models, "smol-st") == elsewhere.resolve()
    assert confined_model_path(models, str(elsewhere)) == elsewhere.resolve()
    with pytest.raises(OutsideModelsDir):
        confined_model_path(models, str(tmp_path / "cache"))  # its parent is not


def test_a_schema_goes_to_vllm_as_structured_outputs() -> None:
    from agent.runtime.vllm import _completion_body

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = _completion_body({"json_schema": schema, "max_tokens": 8}, [1, 2], "d1", 100)
    assert body["structured_outputs"] == {"json": schema}
    assert "structured_outputs" not in _completion_body({"max_tokens": 8}, [1, 2], "d1", 100)


def test_whether_a_model_directorys_template_renders_tools(tmp_path: Path) -> None:
    import json

    from agent.runtime.vllm import chat_template_knows_tools

    plain = "{% for m in messages %}<|im_start|>{{ m['role'] }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": plain}))
    assert not chat_template_knows_tools(tmp_path)
    with_tools = "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}" + plain
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "default", "template": with_tools}]})
    )
    assert chat_template_knows_tools(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert not chat_template_knows_tools(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(with_tools)
    assert chat_template_knows_tools(tmp_path)
