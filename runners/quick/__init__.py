"""The quick commands, implemented once: the agent's control socket, its stdlib
client, the operations both sides run. Imports backend and below."""
