"""The HTTP and WebSocket routes, one module per API family."""
