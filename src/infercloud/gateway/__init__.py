"""The gateway: the OpenAI-compatible front door with tenants, keys, limits and usage records."""
