"""The test suite: a package, so test modules import their shared helpers as
``tests.helpers.<module>`` (pytest puts the repository root on ``sys.path``)."""
