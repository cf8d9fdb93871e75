"""Pagoda worker_svc."""
