"""pytest plugin (loaded with ``-p racon.testing`` before pytest-django sets Django up).

It runs at import time on purpose: Django reads REDIS_URL when settings load, which happens
before any conftest hook. With REDIS_URL unset it starts the embedded Redis; with it set (CI) it
moves to a dedicated database number so the suite never flushes data it does not own.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import tempfile
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from racon.embedded import start_redis

TEST_REDIS_DB = os.environ.get("RACON_TEST_REDIS_DB", "13")

# One test run at a time owns the shared test databases (Redis db 13/14 on REDIS_URL, PostgreSQL's
# test_<name>): each test flushes its Redis database and the run drops its PostgreSQL database at
# the end. A second run on the same machine (several checkouts, or a developer's focused run
# beside a full one) would wipe the first one's state, so it gets its own: an embedded Redis and
# a PostgreSQL test database named after its pid. The lock is held for the life of the process.
_lock = open(os.path.join(tempfile.gettempdir(), "racon-pytest.lock"), "w")
try:
    fcntl.flock(_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
except BlockingIOError:
    os.environ.pop("REDIS_URL", None)
    os.environ["RACON_TEST_DB_NAME"] = f"test_racon_{os.getpid()}"

if not os.environ.get("REDIS_URL"):
    _redis = start_redis(data_dir=Path(tempfile.mkdtemp(prefix="racon-test-redis-")))
    atexit.register(_redis.stop)
    os.environ["REDIS_URL"] = _redis.url
    os.environ["RACON_EMBEDDED_REDIS"] = "1"

_parts = urlsplit(os.environ["REDIS_URL"])
os.environ["REDIS_URL"] = urlunsplit(_parts._replace(path=f"/{TEST_REDIS_DB}"))
# Celery's broker gets its own database: tests flush theirs, which would drop kombu's bindings.
os.environ["CELERY_BROKER_URL"] = urlunsplit(_parts._replace(path=f"/{int(TEST_REDIS_DB) + 1}"))
os.environ.setdefault("NODE_ENROLLMENT_SECRET", "test-enrollment-secret")
os.environ.setdefault("AI_API_KEY", "test-operator-key")
os.environ.setdefault("CELERY_TASK_ALWAYS_EAGER", "true")
os.environ.setdefault("DEBUG", "false")
# The suite shares 127.0.0.1:6379 in CI, whose ACLs are not ours to change: tests that exercise
# per-node Redis users start a private redis-server and turn this on (tests/trust/).
os.environ.setdefault("NODE_REDIS_ACL", "false")
os.environ.setdefault("LOG_FORMAT", "text")
os.environ.setdefault("SPEED_CHALLENGE", "false")  # the speed-challenge tests turn it on
