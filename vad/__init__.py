"""vad package."""
