"""An example under every command's --help, and one-line usage errors (issue 26).

Each command's `--help` ends with an example; a command without one here gets its usage line with
placeholders, so a command added later is never without. `one_line` turns click's usage errors
(no such command or option: click names the closest valid ones) into the one line
`racon …: error: …` instead of a framed box.
"""

from __future__ import annotations

from typing import Any

import typer
import typer.main

EXAMPLES: dict[str, str] = {
    "login": "racon login --url https://10.0.0.5:8000 --key rk_...",
    "version": "racon version",
    "diagnose": "racon diagnose gpu-box -o gpu-box.tar.gz",
    "deploy": "racon deploy smollm2 --replicas 1",
    "chat": 'racon chat smollm2 -m "Say hello in French."',
    "top": "racon top --interval 1",
    "nodes ls": "racon nodes ls --state READY",
    "nodes show": "racon nodes show gpu-box",
    "nodes links": "racon nodes links --json",
    "nodes drain": "racon nodes drain gpu-box",
    "nodes undrain": "racon nodes undrain gpu-box",
    "nodes gpu-challenge": "racon nodes gpu-challenge gpu-box --device CUDA0",
    "nodes gpu-challenge-clear": "racon nodes gpu-challenge-clear gpu-box",
    "tokens create": "racon tokens create desk-1 --ttl-hours 4",
    "tokens ls": "racon tokens ls",
    "tokens revoke": "racon tokens revoke rcn_AbC1",
    "models ls": "racon models ls",
    "models add": "racon models add /srv/models/SmolLM2-135M-Instruct.Q4_1.gguf --name smollm2",
    "deployments ls": "racon deployments ls",
    "deployments stop": "racon deployments stop 3f2a",
    "jobs ls": "racon jobs ls --state RUNNING",
    "jobs show": "racon jobs show 9c1e",
    "jobs cancel": "racon jobs cancel 9c1e",
    "credits balance": "racon credits balance",
    "credits ledger": "racon credits ledger --limit 20",
    "credits verify": "racon credits verify receipt.json",
    "credits earnings": "racon credits earnings",
    "accounts create": "racon accounts create alice",
    "accounts invite": "racon accounts invite bob",
    "accounts ls": "racon accounts ls",
    "accounts list": "racon accounts list",
    "keys create": "racon keys create laptop",
    "keys ls": "racon keys ls",
    "keys list": "racon keys list",
    "keys usage": "racon keys usage",
    "keys revoke": "racon keys revoke rk_AbC1",
    "bundle build": "racon bundle build",
    "bundle upload": "racon bundle upload node-agent-0.1.0-aarch64-1a2b3c4d.tar.gz",
    "bundle ls": "racon bundle ls",
}


def walk(command: Any, path: tuple[str, ...] = ()) -> list[tuple[str, Any]]:
    """(path, click command) of every leaf command under `command`."""
    subs = getattr(command, "commands", None)
    if subs is None:
        return [(" ".join(path), command)]
    return [leaf for name, sub in subs.items() for leaf in walk(sub, (*path, name))]


def _usage_example(path: str, command: Any) -> str:
    words = ["racon", path]
    for p in command.params:
        if getattr(p, "param_type_name", "") == "argument":
            words.append(str(p.name).upper())
        elif p.required:
            words += [p.opts[0], str(p.name).upper()]
    return " ".join(words)


def add_examples(app: typer.Typer) -> Any:
    """The app's click command with `Example: …` as every leaf command's epilog."""
    root = typer.main.get_command(app)
    for path, command in walk(root):
        example = EXAMPLES.get(path) or _usage_example(path, command)
        command.epilog = f"Example: {example}"
    return root


def one_line(exc: Any) -> str:
    """`racon nodes ls: error: No such option: --jsn (Possible options: --json) (…)`"""
    ctx = getattr(exc, "ctx", None)
    where = ctx.command_path if ctx is not None else "racon"
    message = " ".join(exc.format_message().split())
    return f"{where}: error: {message} (`{where} --help` lists them)"
