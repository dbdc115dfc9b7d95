"""lanes package."""
