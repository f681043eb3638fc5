"""pytest hooks for the tf.test suite, and helpers.py on the path of every test file.

imagenet_tpu is imported before any test module imports TensorFlow, so the suite runs with the package's oneDNN
setting (imagenet_tpu/runtime.py), as the command line does.
"""

import os
import sys

from imagenet_tpu import runtime

runtime.import_tensorflow()

# The test files sit in folders that mirror the package (pytest imports them with --import-mode=importlib, so
# two folders may hold files of one name); all of them import the shared helpers.py from here.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_collection_modifyitems(config, items):
    # tf.test.TestCase carries a deprecated `test_session` method that is always skipped; it is not a test.
    kept = [item for item in items if item.name != 'test_session']
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.name == 'test_session'])
        items[:] = kept
    # Files with slow tests (training processes, many replicas) first, each file's tests in their order: pytest-xdist
    # hands out files in this order, so the suite ends on short files, with both processes busy to the end,
    # rather than on one long file with the other process idle.
    slow_files = {item.path for item in items if item.get_closest_marker('slow')}
    items.sort(key=lambda item: item.path not in slow_files)
