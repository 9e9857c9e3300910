"""The two kinds of failure titanlite reports as one line; this module imports nothing of titanlite."""


class ConfigError(ValueError):
    """A user mistake in the configuration, command line or input files; exit code 2."""


class RunError(RuntimeError):
    """A failure during training (non-finite step, failed save, dead peer); exit code 1."""
