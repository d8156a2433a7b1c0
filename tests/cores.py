"""This test process's share of the machine's cores: `scripts/test.sh` runs one pytest-xdist
worker per core, and a worker taking more intra-op threads than its share makes both workers
wait on each other's spinning threads."""

import os


def cores_per_worker() -> int:
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, (os.cpu_count() or 1) // workers)
