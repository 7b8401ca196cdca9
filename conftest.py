"""
The suite's order under `pytest -n 2` (README): the slowest tests first, so that the two workers end
together instead of one running the 4-minute default run alone at the end. A test's `slow` marker
holds its seconds measured on 2 cores (docs/tests.md); without a number it counts as 20. Run
without -n, the suite keeps the file's order. Each worker runs its share of the cores (torch's threads and
those of the runs it starts): N workers at a thread per core each ran N threads a core (docs/tests.md).
"""
import os

if os.environ.get("PYTEST_XDIST_WORKER"):  # (before any test module imports torch)
    given = os.environ.get("OMP_NUM_THREADS")  # a value you set wins
    import threads  # the cores this process may use: fewer than it sees where a CPU quota binds
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ["OMP_NUM_THREADS"] = given or str(max(1, threads.usable_cores() // workers))
    if threads.QUOTA_THREADS:  # train.py hands it to torch: the worker's share, not the whole quota
        threads.QUOTA_THREADS = int(os.environ["OMP_NUM_THREADS"])


def pytest_collection_modifyitems(items):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return

    def seconds(item):
        mark = item.get_closest_marker("slow")
        if mark is None:
            return 0
        return mark.args[0] if mark.args else 20

    items.sort(key=lambda item: -seconds(item))  # stable: equal ones keep the file's order
