"""workers/engines package."""
