#!/usr/bin/env python3
"""Build the wheelhouse the controller hands to joining machines (GET /join/<token>).

    python scripts/build-wheelhouse.py [--force]

Run it with the controller's venv python (`make install` does; the controller also starts it
itself, once, when a join asks for a wheelhouse that is missing or stale). Everything is cached
under ~/.cache/racon/wheelhouse (RACON_CACHE overrides ~/.cache/racon):

    <platform key>/<python abi>/   for machines like this one (key: scripts/platform-key.sh, which
                                  names the GPU backends: ...-cpu-rpc-vulkan is served only to
                                  machines that detect Vulkan too, ...-cpu-rpc to those with none)
        racon_agent-<v>-py3-none-any.whl          the agent, built from this checkout's agent/
        llama_cpp_python-<v>+rpc-py3-none-<plat>.whl  llama-cpp-python with the cached ggml-rpc
                                                  build's libraries inside (no compiler needed)
        llama-cpp-bin-<v>-<key>.tar.gz            llama-server and ggml-rpc-server (bin/)
        every dependency wheel (pip download --only-binary :all:)
        manifest.json                             name, size, sha256 and kind of each file
    source/                                       for machines of another platform or Python
        the agent wheel, the llama-cpp-python sdist, build-llama.sh, platform-key.sh, the
        patches build-llama.sh applies
        manifest.json

Only the standard library is used; pip is run as `<this python> -m pip`. Cheap when cached: the
agent wheel is rebuilt only when agent/ changed, the dependencies only when the requirements did.
Prints the wheelhouse directory on its last line.
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
FORMAT = 1


def log(message: str) -> None:
    print(f"build-wheelhouse: {message}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    return Path(os.environ.get("RACON_CACHE") or Path.home() / ".cache" / "racon")


def llama_version() -> str:
    return os.environ.get("LLAMA_CPP_VERSION", "0.3.36")


def abi_tag() -> str:
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


def platform_key() -> str:
    return subprocess.run(
        [str(SCRIPTS / "platform-key.sh")], check=True, capture_output=True, text=True
    ).stdout.strip()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def agent_source_hash(root: Path = ROOT) -> str:
    """Hash of what goes into the agent wheel: agent/**/*.py and its pyproject."""
    h = hashlib.sha256()
    files = sorted((root / "agent").rglob("*.py")) + [root / "packaging/agent/pyproject.toml"]
    for path in files:
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"build-wheelhouse: {' '.join(cmd[2:5])} failed:\n{proc.stderr[-3000:]}")


# --- the agent wheel -----------------------------------------------------------------------------


def build_agent_wheel(dest: Path) -> Path:
    with tempfile.TemporaryDirectory(prefix="racon-agent-") as tmp:
        stage = Path(tmp) / "src"
        stage.mkdir()
        shutil.copy(ROOT / "packaging/agent/pyproject.toml", stage / "pyproject.toml")
        shutil.copytree(
            ROOT / "agent", stage / "agent", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
        out = Path(tmp) / "out"
        # --no-build-isolation: setuptools and wheel are in the controller's venv already.
        pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(stage))
        (wheel,) = out.glob("racon_agent-*.whl")
        for old in dest.glob("racon_agent-*.whl"):
            old.unlink()
        return Path(shutil.move(str(wheel), dest / wheel.name))


# --- the RPC-enabled llama-cpp-python wheel ------------------------------------------------------


def _record_line(arcname: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def build_llama_wheel(dest: Path, *, src: Path, prefix: Path) -> Path:
    """A wheel of llama-cpp-python's Python package with the cached build's libraries in
    llama_cpp/lib: what scripts/install-llama.sh installs, as one file. Each library is shipped
    under its link name (what ctypes opens) and its soname (what the others link against)."""
    version = llama_version()
    wheel_version = f"{version}+rpc"
    plat = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    name = f"llama_cpp_python-{wheel_version}-py3-none-{plat}.whl"
    info = f"llama_cpp_python-{wheel_version}.dist-info"
    records: list[str] = []
    tmp = dest / f".{name}.tmp"
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:

        def add(arcname: str, data: bytes, mode: int = 0o644) -> None:
            zi = zipfile.ZipInfo(arcname, date_time=(2024, 1, 1, 0, 0, 0))
            zi.external_attr = (0o100000 | mode) << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(zi, data)
            records.append(_record_line(arcname, data))

        pkg = src / "llama_cpp"
        for path in sorted(pkg.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                add(f"llama_cpp/{path.relative_to(pkg)}", path.read_bytes())
        for lib in sorted((prefix / "lib").iterdir()):
            parts = lib.name.split(".so")
            # libX.so and libX.so.0, not libX.so.0.25.3 (nothing opens that name)
            if len(parts) == 2 and parts[1].count(".") <= 1:
                add(f"llama_cpp/lib/{lib.name}", lib.read_bytes(), 0o755)
        meta = (src / "PKG-INFO").read_text()
        meta = meta.replace(f"\nVersion: {version}\n", f"\nVersion: {wheel_version}\n", 1)
        add(f"{info}/METADATA", meta.encode())
        wheel_txt = (
            "Wheel-Version: 1.0\nGenerator: racon build-wheelhouse\nRoot-Is-Purelib: false\n"
            f"Tag: py3-none-{plat}\n"
        )
        add(f"{info}/WHEEL", wheel_txt.encode())
        records.append(f"{info}/RECORD,,")
        zi = zipfile.ZipInfo(f"{info}/RECORD", date_time=(2024, 1, 1, 0, 0, 0))
        zf.writestr(zi, "\n".join(records) + "\n")
    for old in dest.glob("llama_cpp_python-*.whl"):
        old.unlink()
    return Path(shutil.move(str(tmp), dest / name))


def build_server_tarball(dest: Path, *, prefix: Path, key: str) -> Path:
    """bin/llama-server and bin/ggml-rpc-server (RPATH $ORIGIN/../lib: the join script links lib/
    to the llama-cpp-python wheel's llama_cpp/lib, so the libraries travel once)."""
    name = f"llama-cpp-bin-{llama_version()}-{key}.tar.gz"
    tmp = dest / f".{name}.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for exe in ("llama-server", "ggml-rpc-server"):
            tar.add(prefix / "bin" / exe, arcname=f"bin/{exe}")
        # A GPU build (GGML_BACKEND_DL): bin/libggml-<backend>.so -> ../lib/, where ggml looks
        # for its backend modules beside the executable (scripts/build-llama.sh).
        for link in sorted((prefix / "bin").glob("libggml-*.so")):
            if link.is_symlink():
                ti = tarfile.TarInfo(f"bin/{link.name}")
                ti.type = tarfile.SYMTYPE
                ti.linkname = os.readlink(link)
                tar.addfile(ti)
        data = (key + "\n").encode()
        ti = tarfile.TarInfo("PLATFORM")
        ti.size = len(data)
        ti.mtime = int(time.time())
        tar.addfile(ti, io.BytesIO(data))
    for old in dest.glob("llama-cpp-bin-*.tar.gz"):
        old.unlink()
    return Path(shutil.move(str(tmp), dest / name))


# --- the wheelhouse ------------------------------------------------------------------------------


def read_manifest(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_manifest(directory: Path, body: dict[str, object], kinds: dict[str, str]) -> None:
    files = []
    for name, kind in sorted(kinds.items()):
        path = directory / name
        files.append(
            {"name": name, "kind": kind, "size": path.stat().st_size, "sha256": sha256_file(path)}
        )
    body = {**body, "format": FORMAT, "built_at": time.time(), "files": files}
    tmp = directory / "manifest.json.tmp"
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    tmp.replace(directory / "manifest.json")


def build(*, force: bool = False) -> Path:
    key = platform_key()
    abi = abi_tag()
    top = cache_dir() / "wheelhouse"
    house = top / key / abi
    house.mkdir(parents=True, exist_ok=True)
    with open(top / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time (make install, the controller)
        started = time.monotonic()
        old = {} if force else read_manifest(house / "manifest.json")
        # build-llama.sh is cached (it only compiles on a machine without the build).
        prefix = Path(
            subprocess.run(
                [str(SCRIPTS / "build-llama.sh")],
                check=True,
                capture_output=True,
                text=True,
                env={**os.environ, "PIP": str(Path(sys.executable).parent / "pip")},
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        src = cache_dir() / "src" / f"llama_cpp_python-{llama_version()}"
        libs_id = hashlib.sha256(
            b"".join(
                sorted(
                    p.name.encode() + str(p.stat().st_size).encode()
                    for p in (prefix / "lib").iterdir()
                )
            )
            + str((prefix / "lib" / "libllama.so.0").stat().st_mtime_ns).encode()
        ).hexdigest()[:16]
        source_id = agent_source_hash()
        kinds: dict[str, str] = {}

        agent = next(iter(house.glob("racon_agent-*.whl")), None)
        if agent is None or old.get("agent_source") != source_id:
            log(f"building the racon-agent wheel from {ROOT / 'agent'}")
            agent = build_agent_wheel(house)
        kinds[agent.name] = "agent"

        llama = next(iter(house.glob("llama_cpp_python-*.whl")), None)
        if llama is None or old.get("llama_build") != libs_id:
            log(f"packing llama-cpp-python {llama_version()} with ggml-rpc from {prefix}")
            llama = build_llama_wheel(house, src=src, prefix=prefix)
        kinds[llama.name] = "llama-cpp-python"

        tarball = next(iter(house.glob("llama-cpp-bin-*.tar.gz")), None)
        if tarball is None or old.get("llama_build") != libs_id:
            tarball = build_server_tarball(house, prefix=prefix, key=key)
        kinds[tarball.name] = "llama-bin"

        deps_dir = house / "deps"
        # The dependencies are what the agent's and llama-cpp-python's metadata require.
        reqs_id = hashlib.sha256(
            (ROOT / "packaging/agent/pyproject.toml").read_bytes() + (src / "PKG-INFO").read_bytes()
        ).hexdigest()[:16]
        if old.get("requirements") != reqs_id or not deps_dir.is_dir():
            log("downloading the dependency wheels (pip download --only-binary :all:)")
            tmp_deps = house / ".deps.tmp"
            shutil.rmtree(tmp_deps, ignore_errors=True)
            tmp_deps.mkdir()
            pip(
                "download", "-q", "--only-binary", ":all:", "-d", str(tmp_deps),
                "--find-links", str(house), str(agent), str(llama),
            )  # fmt: skip
            for own in (*tmp_deps.glob("racon_agent-*"), *tmp_deps.glob("llama_cpp_python-*")):
                own.unlink()
            shutil.rmtree(deps_dir, ignore_errors=True)
            tmp_deps.rename(deps_dir)
        for dep in sorted(deps_dir.glob("*.whl")):
            kinds[f"deps/{dep.name}"] = "dependency"

        write_manifest(
            house,
            {
                "platform": key,
                "abi": abi,
                "python": f"{sys.version_info.major}.{sys.version_info.minor}",
                "agent_version": agent.name.split("-")[1],
                "agent_source": source_id,
                "llama_cpp_version": llama_version(),
                "llama_build": libs_id,
                "requirements": reqs_id,
            },
            kinds,
        )

        # For machines of another platform: what they need to build llama.cpp themselves.
        source = top / "source"
        source.mkdir(exist_ok=True)
        for stale in source.glob("racon_agent-*.whl"):
            if stale.name != agent.name:
                stale.unlink()
        shutil.copy(agent, source / agent.name)
        sdist = cache_dir() / "src" / f"llama_cpp_python-{llama_version()}.tar.gz"
        shutil.copy(sdist, source / sdist.name)
        for script in ("build-llama.sh", "platform-key.sh"):
            shutil.copy(SCRIPTS / script, source / script)
        # build-llama.sh applies the patches found beside it (the Vulkan-header guard).
        patches = {p.name: "patch" for p in sorted((SCRIPTS / "patches").glob("*.patch"))}
        for name in patches:
            shutil.copy(SCRIPTS / "patches" / name, source / name)
        write_manifest(
            source,
            {
                "agent_version": agent.name.split("-")[1],
                "agent_source": source_id,
                "llama_cpp_version": llama_version(),
            },
            {
                agent.name: "agent",
                sdist.name: "llama-cpp-python-sdist",
                "build-llama.sh": "script",
                "platform-key.sh": "script",
                **patches,
            },
        )
        total = sum(f["size"] for f in read_manifest(house / "manifest.json")["files"])  # type: ignore[index,union-attr]
        log(
            f"wheelhouse for {key} / {abi} ready: {len(kinds)} files, {total / 2**20:.0f} MiB, "
            f"{time.monotonic() - started:.1f} s"
        )
    return house


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--force", action="store_true", help="rebuild every piece")
    args = parser.parse_args()
    print(build(force=args.force))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
