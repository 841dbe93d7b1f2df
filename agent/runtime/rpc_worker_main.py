"""Child process: serve this machine's devices over ggml-rpc. Run by agent.runtime.rpc_worker.

    python -m agent.runtime.rpc_worker_main --endpoint 10.0.0.5:50052 --cache-dir D --threads 8 --msg-fd 5

Writes one JSON line to --msg-fd ({"op": "devices", ...}) just before it starts serving, then
blocks inside ggml for good. Exits 3 when ggml returns (it could not bind), 4 when ggml is unusable.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from agent.runtime.child import watch_parent
from agent.runtime.ggml import Ggml, GgmlUnavailable


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
        ggml = Ggml()
        ggml.backend_load_all()
        devices = ggml.local_devices_to_expose()
        if not devices:
            raise GgmlUnavailable("ggml found no device to expose")
        infos = [ggml.device_info(i, d).as_dict() for i, d in enumerate(devices)]
    except (GgmlUnavailable, OSError) as exc:
        msg.write(json.dumps({"op": "failed", "error": str(exc)}) + "\n")
        return 4
    if args.cache_dir:
        os.makedirs(args.cache_dir, exist_ok=True)
    msg.write(json.dumps({"op": "devices", "devices": infos, "pid": os.getpid()}) + "\n")
    msg.flush()
    sys.stdout.flush()
    ggml.start_rpc_server(args.endpoint, args.cache_dir or None, args.threads, devices)
    # Only reached when ggml could not create the server socket.
    msg.write(json.dumps({"op": "failed", "error": "ggml-rpc could not start its server"}) + "\n")
    return 3


if __name__ == "__main__":
    sys.exit(main())
