"""The standalone bundle's entry point (packaging/agent/node-agent.spec): `node-agent` itself.

The bundle has no `python` to start children with, so its executable also answers the two
interpreter forms the agent uses for its own children, as the real interpreter would:
`node-agent -m MODULE ARGS...` (the RPC worker's child, agent.runtime.rpc_worker_main) and
`node-agent -c CODE ARGS...` (the exec wrapper in front of llama-server, the GPU benchmark).
Anything else is the `node-agent` command line (agent/cli.py).
"""

from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    # The bootloader points LD_LIBRARY_PATH at _internal/ for this process (ld.so read it at
    # start already). Children must not inherit it: llama-server and ggml-rpc-server load their
    # own libraries (RPATH $ORIGIN/../lib), and a child `node-agent` gets it set again anyway.
    orig = os.environ.pop("LD_LIBRARY_PATH_ORIG", None)
    if orig is not None:
        os.environ["LD_LIBRARY_PATH"] = orig
    else:
        os.environ.pop("LD_LIBRARY_PATH", None)
    argv = sys.argv[1:]
    if len(argv) >= 2 and argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        sys.exit(0)
    if len(argv) >= 2 and argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        sys.exit(0)
    from agent.cli import entrypoint  # noqa: PLC0415 - after the child forms, which never need it

    entrypoint()


if __name__ == "__main__":
    main()
