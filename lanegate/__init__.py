"""lanegate package."""
