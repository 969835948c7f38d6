"""The gateway: HTTP, SSE and WebSocket in front, the message bus behind."""
