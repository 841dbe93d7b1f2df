"""The GPU speed challenge's work on the node (agent/hardware/gpu_challenge.py has the arithmetic,
apps/nodes/gpu_challenges.py the protocol): one matrix product on one named device through the
node's own llama.cpp build (ggml's graph API over ctypes), in two phases.

The work runs in a child process (``main``), as the device scan does: initialising a backend
creates a device context (hundreds of MiB of VRAM on CUDA) that the agent must not keep, and a
driver crash then costs the challenge, not the agent. The child lives for one challenge: it builds
the seed's inputs, puts them on the device and runs the graph once with a zero scale (kernels,
pipelines, a BLAS handle: the fixed costs stay out of the timed step), says it is ready, then waits
on its stdin for the nonce, computes ``B·D·Aᵀ`` with the nonce's D, answers the residues' digest,
and hands the residues over when asked. The agent's side (``GpuChallengeSteps``) checks each
controller step against the challenge it holds (a run without a prepare, a second nonce, another
challenge's id are refused) and drops a challenge left idle.

The device is selected by llama.cpp's name (``CUDA0``, ``Vulkan0``), so the work runs where the
inventory says the GPU is; the backend's own variable (GGML_VK_VISIBLE_DEVICES,
CUDA_VISIBLE_DEVICES) is inherited from the agent.
"""

from __future__ import annotations

import base64
import collections
import ctypes
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from agent.hardware.gpu_challenge import (
    challenge_inputs,
    nonce_scale,
    residue_digest,
    residues,
)
from agent.runtime.ggml import Ggml, GgmlUnavailable, build_lib_dir

GGML_TYPE_F32 = 0
GGML_PREC_F32 = 10
GGML_PREC_F16 = 20
GGML_STATUS_SUCCESS = 0


class _InitParams(ctypes.Structure):
    _fields_ = [
        ("mem_size", ctypes.c_size_t),
        ("mem_buffer", ctypes.c_void_p),
        ("no_alloc", ctypes.c_bool),
    ]


class DeviceMatmul:
    """ggml's graph calls needed for ``mul_mat(A·D, B)`` on one backend device."""

    def __init__(self, ggml: Ggml) -> None:
        self.ggml = ggml
        vp, sz, i64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64
        fn = ggml._fn
        self.init = fn("ggml_init", vp, [_InitParams])
        self.free = fn("ggml_free", None, [vp])
        self.tensor_overhead = fn("ggml_tensor_overhead", sz, [])
        self.graph_overhead = fn("ggml_graph_overhead", sz, [])
        self.new_tensor_2d = fn("ggml_new_tensor_2d", vp, [vp, ctypes.c_int, i64, i64])
        self.mul_mat = fn("ggml_mul_mat", vp, [vp, vp, vp])
        self.mul = fn("ggml_mul", vp, [vp, vp, vp])
        self.new_graph = fn("ggml_new_graph", vp, [vp])
        self.build_forward_expand = fn("ggml_build_forward_expand", None, [vp, vp])
        self.dev_by_name = fn("ggml_backend_dev_by_name", vp, [ctypes.c_char_p])
        self.dev_init = fn("ggml_backend_dev_init", vp, [vp, ctypes.c_char_p])
        self.backend_free = fn("ggml_backend_free", None, [vp])
        self.alloc_ctx_tensors = fn("ggml_backend_alloc_ctx_tensors", vp, [vp, vp])
        self.buffer_free = fn("ggml_backend_buffer_free", None, [vp])
        self.tensor_set = fn("ggml_backend_tensor_set", None, [vp, vp, sz, sz])
        self.tensor_get = fn("ggml_backend_tensor_get", None, [vp, vp, sz, sz])
        self.graph_compute = fn("ggml_backend_graph_compute", ctypes.c_int, [vp, vp])
        self.synchronize = fn("ggml_backend_synchronize", None, [vp])
        # Ask for float32 accumulation where the build can be told (newer ggml: ggml_prec_set_acc;
        # older: ggml_mul_mat_set_prec). The inputs are exact in any float type either way.
        self.set_acc: Any = self._optional("ggml_prec_set_acc", ctypes.c_bool, [vp, ctypes.c_int])
        if self.set_acc is None:
            self.set_acc = self._optional("ggml_mul_mat_set_prec", None, [vp, ctypes.c_int])
        # Never quantize the inputs below float16 (a Q8 scale of 1/127 is not exact).
        self.set_src: Any = self._optional(
            "ggml_prec_set_src", ctypes.c_bool, [vp, ctypes.c_int, ctypes.c_int]
        )

    def _optional(self, name: str, restype: object, argtypes: list[object]) -> Any:
        try:
            return self.ggml._fn(name, restype, argtypes)
        except GgmlUnavailable:
            return None

    def prepare(self, device: str, a: np.ndarray, b: np.ndarray) -> PreparedProduct:
        """A (n×k) and B (m×k) on ``device``, in the graph ``B·(A·diag(d))ᵀ`` whose d comes later."""
        n, k = a.shape
        m, k2 = b.shape
        if k != k2:
            raise ValueError(f"inner sizes differ: {k} and {k2}")
        dev = self.dev_by_name(device.encode())
        if not dev:
            names = ", ".join(d.name for d in self.ggml.devices())
            raise GgmlUnavailable(f"no device {device} in this llama.cpp build (it has: {names})")
        backend = self.dev_init(dev, None)
        if not backend:
            raise GgmlUnavailable(f"{device}: the backend could not be initialised")
        params = _InitParams(
            mem_size=int(self.tensor_overhead()) * 8 + int(self.graph_overhead()),
            mem_buffer=None,
            no_alloc=True,
        )
        ctx = self.init(params)
        prepared = PreparedProduct(self, device=device, backend=backend, ctx=ctx, m=m, n=n, k=k)
        try:
            prepared.ta = self.new_tensor_2d(ctx, GGML_TYPE_F32, k, n)
            prepared.tb = self.new_tensor_2d(ctx, GGML_TYPE_F32, k, m)
            prepared.td = self.new_tensor_2d(ctx, GGML_TYPE_F32, k, 1)  # broadcast over A's rows
            scaled = self.mul(ctx, prepared.ta, prepared.td)
            prepared.tc = self.mul_mat(ctx, scaled, prepared.tb)  # ne = [n, m]: m rows of n
            if self.set_acc is not None:
                self.set_acc(prepared.tc, GGML_PREC_F32)
            if self.set_src is not None:
                self.set_src(prepared.tc, GGML_PREC_F16, 1)  # ggml takes a rank for src[1] only
            prepared.graph = self.new_graph(ctx)
            self.build_forward_expand(prepared.graph, prepared.tc)
            prepared.buf = self.alloc_ctx_tensors(ctx, backend)
            if not prepared.buf:
                raise GgmlUnavailable(f"{device}: could not allocate {4 * k * (m + n + 1)} bytes")
            fa = np.ascontiguousarray(a, dtype=np.float32)
            fb = np.ascontiguousarray(b, dtype=np.float32)
            self.tensor_set(prepared.ta, fa.ctypes.data, 0, fa.nbytes)
            self.tensor_set(prepared.tb, fb.ctypes.data, 0, fb.nbytes)
            self.synchronize(backend)
        except BaseException:
            prepared.close()
            raise
        return prepared


class PreparedProduct:
    """A and B resident on one device, the graph built: ``compute(d)`` uploads d (k floats), runs
    the graph and reads C back."""

    def __init__(
        self, mm: DeviceMatmul, *, device: str, backend: Any, ctx: Any, m: int, n: int, k: int
    ) -> None:
        self.mm, self.device, self.backend, self.ctx = mm, device, backend, ctx
        self.m, self.n, self.k = m, n, k
        self.ta: Any = None
        self.tb: Any = None
        self.td: Any = None
        self.tc: Any = None
        self.graph: Any = None
        self.buf: Any = None

    def compute(self, scale: np.ndarray) -> np.ndarray:
        """``B·diag(scale)·Aᵀ`` (m×n, float32) on the device."""
        fd = np.ascontiguousarray(scale, dtype=np.float32)
        if fd.shape != (self.k,):
            raise ValueError(
                f"the scale has {fd.size} entries, the product's inner size is {self.k}"
            )
        mm = self.mm
        mm.tensor_set(self.td, fd.ctypes.data, 0, fd.nbytes)
        status = int(mm.graph_compute(self.backend, self.graph))
        if status != GGML_STATUS_SUCCESS:
            raise GgmlUnavailable(f"{self.device}: graph compute failed (status {status})")
        mm.synchronize(self.backend)
        out = np.empty((self.m, self.n), dtype=np.float32)
        mm.tensor_get(self.tc, out.ctypes.data, 0, out.nbytes)
        return out

    def close(self) -> None:
        mm = self.mm
        if self.buf:
            mm.buffer_free(self.buf)
            self.buf = None
        if self.ctx:
            mm.free(self.ctx)
            self.ctx = None
        if self.backend:
            mm.backend_free(self.backend)
            self.backend = None


def challenge_prepare(
    *, device: str, seed: int, m: int, n: int, k: int, lib_dir: Path | None = None
) -> PreparedProduct:
    """The prepare phase in this process: the seed's inputs on ``device``, the graph run once with
    a zero scale (the fixed costs; its product, all zeros, is no part of any nonce's)."""
    ggml = Ggml(lib_dir or build_lib_dir())
    ggml.load_backends()
    a, b = challenge_inputs(seed=seed, m=m, n=n, k=k)
    prepared = DeviceMatmul(ggml).prepare(device, a, b)
    try:
        prepared.compute(np.zeros(k, dtype=np.float32))
    except BaseException:
        prepared.close()
        raise
    return prepared


def _say(out: IO[str], obj: dict[str, Any]) -> None:
    out.write(json.dumps(obj, separators=(",", ":")) + "\n")
    out.flush()


def main(argv: Sequence[str] | None = None, *, stdin: IO[str] | None = None) -> int:
    """``python -c '…main()' '<json>'``: the child of one challenge. The argument is
    {"device", "seed", "m", "n", "k"}; it answers one JSON line per step on stdout:
    {"ready": true, …} (or {"error"}), then for each stdin line {"ping": x} → {"pong": x},
    {"nonce": N} → {"nonce": N, "digest"} (once), {"reveal": true} → {"answer"} and exits.
    Anything else, or a step out of order, is {"error"}; stdin's end ends the child."""
    args = list(sys.argv[1:] if argv is None else argv)
    out, src = sys.stdout, stdin or sys.stdin
    try:
        req = json.loads(args[0])
        device, seed = str(req["device"]), int(req["seed"])
        m, n, k = int(req["m"]), int(req["n"]), int(req["k"])
        started = time.monotonic()
        prepared = challenge_prepare(device=device, seed=seed, m=m, n=n, k=k)
    except (GgmlUnavailable, OSError, ValueError, KeyError, IndexError) as exc:
        _say(out, {"error": str(exc)})
        return 0
    try:
        _say(out, {"ready": True, "device": device, "m": m, "n": n, "k": k,
                   "seconds": round(time.monotonic() - started, 3)})  # fmt: skip
        raw: bytes | None = None
        for line in src:
            try:
                msg = json.loads(line)
                if not isinstance(msg, dict):
                    raise ValueError("not an object")
            except ValueError:
                _say(out, {"error": f"not a JSON object: {line[:80]!r}"})
                continue
            if "ping" in msg:
                _say(out, {"pong": msg["ping"]})
            elif "nonce" in msg:
                if raw is not None:
                    _say(out, {"error": "this challenge took its nonce already"})
                    continue
                nonce = int(msg["nonce"])
                raw = residues(prepared.compute(nonce_scale(nonce=nonce, k=k)))
                _say(out, {"nonce": nonce, "digest": residue_digest(raw, nonce=nonce)})
            elif msg.get("reveal") is True:
                if raw is None:
                    _say(out, {"error": "no product to reveal: the nonce never came"})
                    continue
                _say(out, {"answer": base64.b64encode(raw).decode()})
                return 0
            else:
                _say(out, {"error": f"unknown step {sorted(msg)}"})
    except (GgmlUnavailable, ValueError, TypeError) as exc:
        _say(out, {"error": str(exc)})
    finally:
        prepared.close()
    return 0


# Not `-m`: the package imports this module first, and runpy warns.
_CHILD = "import sys; from agent.runtime.ggml_matmul import main; sys.exit(main())"


class ChallengeChild:
    """``main`` in a child process, spoken to one JSON line at a time. Every answer is
    ``{"error": …}`` when the child failed, crashed or ran past its time (it is then killed)."""

    def __init__(self, request: dict[str, Any]) -> None:
        self.device = str(request.get("device"))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, json.dumps(request)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "GGML_NO_BACKTRACE": "1"},
        )
        self._lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._stderr: collections.deque[str] = collections.deque(maxlen=20)
        threading.Thread(target=self._read, daemon=True, name="gpu-challenge-out").start()
        threading.Thread(target=self._drain, daemon=True, name="gpu-challenge-err").start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            # A driver may print on stdout too: only the child's JSON objects are answers.
            if line.startswith("{"):
                try:
                    self._lines.put(json.loads(line))
                except ValueError:
                    continue
        self._lines.put(None)

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._stderr.append(line)

    def ask(self, message: dict[str, Any] | None, *, timeout: float) -> dict[str, Any]:
        """Send ``message`` (None: only wait, for the ready line) and wait for the next answer."""
        if message is not None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps(message) + "\n")
                self.proc.stdin.flush()
            except (OSError, ValueError):
                pass  # it died: its end of output says how
        try:
            got = self._lines.get(timeout=timeout)
        except queue.Empty:
            self.close()
            return {"error": f"the product on {self.device} took over {timeout:.0f} s"}
        if got is None:
            code = self.proc.wait()
            tail = "".join(self._stderr)[-300:]
            return {"error": f"the challenge's process exited {code}: {tail}"}
        return got

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass


class StepRefused(ValueError):
    """A controller step this node refuses (the agent turns it into a CommandError)."""


CHALLENGE_ID = re.compile(r"[0-9a-f]{16,64}")
DIGEST = re.compile(r"[0-9a-f]{64}")
SESSION_IDLE_S = 120.0  # a prepared challenge whose next step does not come is dropped


class _Session:
    def __init__(self, challenge_id: str, child: ChallengeChild, shape: tuple[int, int, int]):
        self.challenge_id, self.child, self.shape = challenge_id, child, shape
        self.phase = "ready"  # ready → ran → (revealed: gone)
        self.last_step = time.monotonic()


class GpuChallengeSteps:
    """The node's side of the two-phase GPU challenge (apps/nodes/gpu_challenges.py), one
    challenge at a time, each step checked against the challenge held:

    - ``prepare`` {challenge_id, device, seed, m, n, k}: a child builds the inputs on the device;
      {ready, challenge_id, device, m, n, k} once they are there. A new prepare drops the old one;
    - ``ping`` {challenge_id, token}: {pong: token} through the child (the channel's own cost);
    - ``run`` {challenge_id, nonce}: the timed step, once: {nonce, digest};
    - ``reveal`` {challenge_id}: after the run, the residues: {answer}; the challenge ends.
    """

    def __init__(
        self,
        *,
        max_side: int,
        max_k: int,
        device_name: re.Pattern[str] | None,
        timeout: float,
        idle: float = SESSION_IDLE_S,
        spawn: Callable[[dict[str, Any]], ChallengeChild] = ChallengeChild,
    ) -> None:
        self.max_side, self.max_k, self.device_name = max_side, max_k, device_name
        self.timeout, self.idle, self.spawn = timeout, idle, spawn
        self._lock = threading.Lock()
        self._current: _Session | None = None
        self._timer: threading.Timer | None = None

    def step(self, payload: dict[str, Any]) -> dict[str, Any]:
        step = payload.get("step")
        challenge_id = payload.get("challenge_id")
        if not isinstance(challenge_id, str) or not CHALLENGE_ID.fullmatch(challenge_id):
            raise StepRefused("needs a challenge_id of 16 to 64 lowercase hex digits")
        with self._lock:
            try:
                return self._step(step, challenge_id, payload)
            finally:
                self._arm()

    def _step(self, step: Any, challenge_id: str, payload: dict[str, Any]) -> dict[str, Any]:
        self._expire()
        if step == "prepare":
            return self._prepare(challenge_id, payload)
        if step not in ("ping", "run", "reveal"):
            raise StepRefused(f"unknown step {step!r} (prepare, ping, run or reveal)")
        session = self._current
        if session is None:
            raise StepRefused(f"{step} of challenge {challenge_id}: nothing is prepared here")
        if session.challenge_id != challenge_id:
            raise StepRefused(
                f"{step} of challenge {challenge_id}: the challenge prepared here is "
                f"{session.challenge_id}"
            )
        session.last_step = time.monotonic()
        if step == "ping":
            return self._ping(session, payload)
        if step == "run":
            return self._run(session, payload)
        return self._reveal(session)

    def close(self) -> None:
        with self._lock:
            self._drop()
            self._arm()

    def _arm(self) -> None:
        """While a challenge is held, a watchdog drops it once idle: its child holds the inputs
        in the device's memory, and the next step may never come."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._current is not None:
            self._timer = threading.Timer(self.idle + 1.0, self._watchdog)
            self._timer.daemon = True
            self._timer.start()

    def _watchdog(self) -> None:
        if not self._lock.acquire(blocking=False):
            return  # a step is running: it arms the watchdog again when it ends
        try:
            self._expire()
            self._arm()
        finally:
            self._lock.release()

    def _drop(self) -> None:
        if self._current is not None:
            self._current.child.close()
            self._current = None

    def _expire(self) -> None:
        if self._current is not None and time.monotonic() - self._current.last_step > self.idle:
            self._drop()

    def _fail(self, step: str, got: dict[str, Any]) -> StepRefused:
        self._drop()
        return StepRefused(f"{step} failed: {got.get('error') or f'unexpected answer {got}'}")

    def _prepare(self, challenge_id: str, payload: dict[str, Any]) -> dict[str, Any]:
        try:
            device = str(payload["device"])
            seed, m, n, k = (int(payload[key]) for key in ("seed", "m", "n", "k"))
        except (KeyError, TypeError, ValueError):
            raise StepRefused("prepare needs device and integer seed, m, n and k") from None
        if not (
            (self.device_name is None or self.device_name.fullmatch(device))
            and 0 <= seed < 2**63
            and 1 <= m <= self.max_side
            and 1 <= n <= self.max_side
            and 1 <= k <= self.max_k
        ):
            raise StepRefused(
                "prepare needs a GPU's llama.cpp name, 0 <= seed < 2^63, "
                f"1 <= m, n <= {self.max_side}, 1 <= k <= {self.max_k}"
            )
        self._drop()
        child = self.spawn({"device": device, "seed": seed, "m": m, "n": n, "k": k})
        self._current = _Session(challenge_id, child, (m, n, k))
        got = child.ask(None, timeout=self.timeout)
        if got.get("ready") is not True:
            raise self._fail(f"prepare on {device}", got)
        self._current.last_step = time.monotonic()
        return {"step": "prepare", "challenge_id": challenge_id, "ready": True,
                "device": device, "m": m, "n": n, "k": k}  # fmt: skip

    def _ping(self, session: _Session, payload: dict[str, Any]) -> dict[str, Any]:
        token = payload.get("token")
        if not isinstance(token, str) or len(token) > 64:
            raise StepRefused("ping needs a token (a string of at most 64 characters)")
        got = session.child.ask({"ping": token}, timeout=self.timeout)
        if got.get("pong") != token:
            raise self._fail("ping", got)
        return {"step": "ping", "challenge_id": session.challenge_id, "pong": token}

    def _run(self, session: _Session, payload: dict[str, Any]) -> dict[str, Any]:
        nonce = payload.get("nonce")
        if isinstance(nonce, bool) or not isinstance(nonce, int) or not 0 <= nonce < 2**63:
            raise StepRefused("run needs an integer nonce, 0 <= nonce < 2^63")
        if session.phase != "ready":
            raise StepRefused(f"challenge {session.challenge_id} took its nonce already")
        session.phase = "ran"
        got = session.child.ask({"nonce": nonce}, timeout=self.timeout)
        digest = got.get("digest")
        if got.get("nonce") != nonce or not isinstance(digest, str) or not DIGEST.fullmatch(digest):
            raise self._fail("run", got)
        session.last_step = time.monotonic()
        return {"step": "run", "challenge_id": session.challenge_id, "nonce": nonce,
                "digest": digest}  # fmt: skip

    def _reveal(self, session: _Session) -> dict[str, Any]:
        if session.phase != "ran":
            raise StepRefused(
                f"challenge {session.challenge_id} has no product to reveal: its nonce never came"
            )
        got = session.child.ask({"reveal": True}, timeout=self.timeout)
        self._drop()
        if not isinstance(got.get("answer"), str):
            raise StepRefused(f"reveal failed: {got.get('error') or f'unexpected answer {got}'}")
        return {"step": "reveal", "challenge_id": session.challenge_id, "answer": got["answer"]}
