"""What operators use: /health, /v1/memory, /metrics and the status page (static/), the
recent history, API keys and access rules, CURVE keys and the server side of CURVE,
`mlx-router status`, the service files and the runtime dir for ipc:// sockets."""
