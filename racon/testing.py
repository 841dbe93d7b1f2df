"""pytest plugin (loaded with ``-p racon.testing`` before pytest-django sets Django up).

It runs at import time on purpose: Django reads REDIS_URL when settings load, which happens
before any conftest hook. With REDIS_URL unset it starts the embedded Redis; with it set (CI) it
moves to a dedicated database number so the suite never flushes data it does not own.
"""

from __future__ import annotations

import atexit
import os
import tempfile
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from racon.embedded import start_redis

TEST_REDIS_DB = os.environ.get("RACON_TEST_REDIS_DB", "13")

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
