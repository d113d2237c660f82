"""HTTP and WebSocket routes: each module translates one surface of the service."""
