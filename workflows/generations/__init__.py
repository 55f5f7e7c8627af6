"""Generations: created, exec'd, made ready, given socket access and listeners, ended
(SIGTERM, drain, SIGKILL, proof). Imports base, builds, leases."""
