"""What jobs tells the apps above it (api: metrics), as signals it sends and never imports for."""

from __future__ import annotations

from django.dispatch import Signal

# Sent with job_id, state (the terminal state) and fields (usage and timings) when a job finishes;
# the api layer's metrics count it. Receivers must not raise: the finish has been written.
job_finished = Signal()
