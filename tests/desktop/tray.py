"""Activate a live tray menu item the way a panel does: libayatana-appindicator exports the tray's
GTK menu over D-Bus (com.canonical.dbusmenu); a panel sends ``Event(id, "clicked")`` for the item
the user clicked, and GTK activates it, which is what Tauri's menu handler hears. Nothing here
calls the app's handler."""

from __future__ import annotations

import re
import subprocess

MENU_IFACE = "com.canonical.dbusmenu"


def gdbus(env: dict[str, str], *args: str) -> str:
    out = subprocess.run(
        ["gdbus", "call", "--session", *args], env=env, capture_output=True, text=True, timeout=20
    )
    if out.returncode != 0:
        raise RuntimeError(f"gdbus {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def find_menus(env: dict[str, str]) -> list[tuple[str, str]]:
    """(bus name, object path) of every exported dbusmenu on the session bus."""
    names = re.findall(
        r"'(:1\.\d+)'",
        gdbus(env, "--dest", "org.freedesktop.DBus", "--object-path", "/org/freedesktop/DBus",
              "--method", "org.freedesktop.DBus.ListNames"),
    )  # fmt: skip
    found = []
    for name in names:
        intro = subprocess.run(
            ["gdbus", "introspect", "--session", "--dest", name, "--object-path", "/", "--recurse"],
            env=env, capture_output=True, text=True, timeout=20,
        )  # fmt: skip
        path = None
        for line in intro.stdout.splitlines():
            m = re.match(r"\s*node (/\S*) \{", line)
            if m:
                path = m.group(1)
            elif f"interface {MENU_IFACE} " in line and path:
                found.append((name, path))
    return found


def item_ids(env: dict[str, str], name: str, path: str) -> dict[str, int]:
    """The menu's items: label → dbusmenu id."""
    layout = gdbus(
        env, "--dest", name, "--object-path", path, "--method", f"{MENU_IFACE}.GetLayout",
        "0", "10", "[]",
    )  # fmt: skip
    return {
        label: int(i) for i, label in re.findall(r"\((\d+), \{[^}]*?'label': <'([^']*)'>", layout)
    }


def click(env: dict[str, str], label: str) -> None:
    """Click the tray menu item labelled ``label`` (the first exported menu that has one)."""
    menus = find_menus(env)
    for name, path in menus:
        ids = item_ids(env, name, path)
        if label in ids:
            gdbus(
                env, "--dest", name, "--object-path", path, "--method", f"{MENU_IFACE}.Event",
                str(ids[label]), "clicked", "<int32 0>", "0",
            )  # fmt: skip
            return
    raise AssertionError(f"no tray menu item {label!r} on the session bus (menus: {menus})")
