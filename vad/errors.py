"""The one exception type the VAD raises."""


class VadError(ValueError):
    """Input or settings the VAD cannot process (never a silent wrong result)."""
