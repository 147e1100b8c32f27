"""The engine server: one replica speaking the OpenAI API over HTTP and SSE."""
