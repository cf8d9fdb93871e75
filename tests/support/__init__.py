"""Shared test helpers (importable as `support.*`; pytest puts tests/ on sys.path)."""
