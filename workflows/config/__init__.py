"""Host definitions, the status read model, and `vigil apply`. Imports rollouts and below."""
