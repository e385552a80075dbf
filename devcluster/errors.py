"""The one exception the dev cluster raises, so callers can tell setup failures from test failures."""


class DevClusterError(RuntimeError):
    """The local control plane could not be built, started, reached or stopped."""
