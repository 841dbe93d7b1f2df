"""Turn a llama GGUF into a safetensors model directory vLLM loads (FACTS.md "vLLM on the CPU").

Run with the vLLM engine venv's python (it has torch, transformers, gguf and accelerate):

    python scripts/gguf_to_safetensors.py MODEL.gguf OUT_DIR [--dtype bfloat16]

Offline: nothing comes from a hub. `save_pretrained` refuses a GGUF-dequantized model, so the state
dict is written with safetensors (lm_head dropped when tied to the embeddings), the config loses
its quantization_config and names LlamaForCausalLM. OUT_DIR/SHA256SUMS lists every file's sha256
(`sha256sum -c` format), the manifest `racon models add DIR` checks.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args(argv)

    import torch  # noqa: PLC0415  (the engine venv has torch, the project venv does not)
    from safetensors.torch import save_file  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    src: Path = args.gguf.resolve()
    if not src.is_file():
        print(f"error: {src} is not a file", file=sys.stderr)
        return 1
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=dtype)
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if tied:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.torch_dtype = dtype
    cfg.save_pretrained(out)
    raw = json.loads((out / "config.json").read_text())
    raw.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    tok.save_pretrained(out)
    files = sorted(p for p in out.iterdir() if p.is_file() and p.name != "SHA256SUMS")
    lines = [f"{sha256(p)}  {p.name}\n" for p in files]
    (out / "SHA256SUMS").write_text("".join(lines))
    print(
        f"wrote {out} ({sum(p.stat().st_size for p in files) / 2**20:.0f} MiB, {len(files)} files)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
