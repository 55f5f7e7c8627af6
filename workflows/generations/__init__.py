"""Generations: created, exec'd, made ready, given socket access and listeners, ended
(the stop signal, drain, SIGKILL, proof). Imports base, builds, leases."""
