"""The Linux side of the workflow ports: processes and containment, limits, files,
health, readiness, listening sockets, socket access. Imports base and keepers."""
