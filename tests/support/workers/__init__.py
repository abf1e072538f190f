"""Scripts the tests start as ranks or child processes (collective, DCP, manager, framework jobs).

Each one runs by path (``python tests/support/workers/<name>.py ...``): it puts tests/support first on
sys.path and imports its siblings as ``workers.<name>``, as the tests that read its constants do.
"""
