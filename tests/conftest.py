"""pytest hooks for the tf.test suite."""


def pytest_collection_modifyitems(config, items):
    # tf.test.TestCase carries a deprecated `test_session` method that is always skipped; it is not a test.
    kept = [item for item in items if item.name != 'test_session']
    if len(kept) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.name == 'test_session'])
        items[:] = kept
