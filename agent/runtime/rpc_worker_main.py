"""Child process: serve this machine's devices over ggml-rpc. Run by agent.runtime.rpc_worker.

    python -m agent.runtime.rpc_worker_main --endpoint 127.0.0.1:PORT --cache-dir D --threads 8 --msg-fd 5

It reads the devices to lend through ggml's registry (agent/runtime/ggml.py, loaded from the
backend build's own lib/, so no llama-cpp-python is needed: the standalone bundle has none), writes
one JSON line to --msg-fd ({"op": "devices", ...}), then becomes the build's `ggml-rpc-server`
(execve: same pid, so the agent supervises it as before) serving those devices: the CPU, with
--threads (the lending policy's cap), and every GPU of a GPU build. Exit 4 before the exec when
ggml or the binary is unusable.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
from pathlib import Path

from agent.runtime import RuntimeErrorReport
from agent.runtime.child import watch_parent
from agent.runtime.ggml import Ggml, GgmlUnavailable
from agent.runtime.server import find_llama_server


def find_rpc_server() -> Path:
    """`ggml-rpc-server` of the same build as llama-server (RACON_RPC_SERVER overrides)."""
    explicit = os.environ.get("RACON_RPC_SERVER")
    binary = Path(explicit) if explicit else find_llama_server().parent / "ggml-rpc-server"
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        raise GgmlUnavailable(
            f"ggml-rpc-server not found at {binary}: run scripts/install-llama.sh (make install), "
            "or set RACON_RPC_SERVER"
        )
    return binary


def build_lib_dir(binary: Path) -> Path | None:
    """The build's lib/ beside bin/ (what the binary's RPATH $ORIGIN/../lib loads), if present."""
    lib = binary.resolve().parent.parent / "lib"
    return lib if (lib / "libggml.so.0").exists() else None


def split_endpoint(endpoint: str) -> tuple[str, str]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), port


def rpc_server_argv(
    binary: Path, endpoint: str, threads: int, device_names: list[str], cache: bool
) -> list[str]:
    host, port = split_endpoint(endpoint)
    argv = [str(binary), "-H", host, "-p", port, "-t", str(max(1, threads))]
    argv += ["-d", ",".join(device_names)]
    return argv + (["-c"] if cache else [])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rpc-worker")
    p.add_argument("--endpoint", required=True)
    p.add_argument("--cache-dir", default="")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--msg-fd", type=int, required=True)
    args = p.parse_args(argv)
    watch_parent()
    msg = os.fdopen(args.msg_fd, "w", buffering=1)

    try:
        binary = find_rpc_server()
        ggml = Ggml(build_lib_dir(binary))
        ggml.backend_load_all()
        devices = ggml.local_devices_to_expose()
        if not devices:
            raise GgmlUnavailable("ggml found no device to expose")
        infos = [ggml.device_info(i, d).as_dict() for i, d in enumerate(devices)]
    except (GgmlUnavailable, RuntimeErrorReport, OSError) as exc:
        msg.write(json.dumps({"op": "failed", "error": str(exc)}) + "\n")
        return 4
    env = dict(os.environ)
    if args.cache_dir:
        os.makedirs(args.cache_dir, exist_ok=True)
        # ggml-rpc-server -c caches large tensors in $LLAMA_CACHE/rpc.
        env["LLAMA_CACHE"] = args.cache_dir
    env["GGML_NO_BACKTRACE"] = "1"
    cmd = rpc_server_argv(
        binary, args.endpoint, args.threads, [str(i["name"]) for i in infos], bool(args.cache_dir)
    )
    hello = {"op": "devices", "devices": infos, "pid": os.getpid(), "binary": str(binary)}
    msg.write(json.dumps(hello) + "\n")
    msg.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # The server dies with the agent even when the agent is SIGKILLed (PR_SET_PDEATHSIG survives
    # execve; this process has one thread, and the agent starts workers from long-lived threads).
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
    os.execve(cmd[0], cmd, env)
    return 3  # not reached: execve raises OSError on failure


if __name__ == "__main__":
    sys.exit(main())
