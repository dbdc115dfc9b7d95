"""lanegate's benchmark: the designs side by side in one run (`python -m bench run`)."""
