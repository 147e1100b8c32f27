"""Routing: which replica serves a request (policies, the KV-cache index, replica health)."""
