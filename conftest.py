"""
The suite's order under `pytest -n 2` (README): the slowest tests first, so that the two workers end
together instead of one running the 4-minute default run alone at the end. A test's `slow` marker
holds its seconds measured on 2 cores (docs/tests.md); without a number it counts as 20. Run
without -n, the suite keeps the file's order.
"""
import os


def pytest_collection_modifyitems(items):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return

    def seconds(item):
        mark = item.get_closest_marker("slow")
        if mark is None:
            return 0
        return mark.args[0] if mark.args else 20

    items.sort(key=lambda item: -seconds(item))  # stable: equal ones keep the file's order
