"""What runs the workflows: the agent daemon (APScheduler), the reconciler, the process
backends (psutil, cgroup v2, env marker), health checks, the filesystem port and the CLI."""
