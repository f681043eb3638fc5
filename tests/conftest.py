"""pytest hooks for the tf.test suite.

imagenet_tpu is imported before any test module imports TensorFlow, so the suite runs with the package's oneDNN
setting (imagenet_tpu/runtime.py), as the command line does.
"""

from imagenet_tpu import runtime

runtime.import_tensorflow()


def pytest_collection_modifyitems(config, items):
    # tf.test.TestCase carries a deprecated `test_session` method that is always skipped; it is not a test.
    kept = [item for item in items if item.name != 'test_session']
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.name == 'test_session'])
        items[:] = kept
