"""Pagoda scheduler_svc."""
