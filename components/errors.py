"""The one exception type for bad user input: train.py prints its message and exits non-zero."""


class KilnError(Exception):
    """A problem with the user's config, data, checkpoint or layout, explained in its message."""
