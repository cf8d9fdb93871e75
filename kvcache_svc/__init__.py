"""Pagoda kvcache_svc."""
