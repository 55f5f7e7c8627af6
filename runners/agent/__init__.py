"""The agent daemon: its start and stop, reconciler, clocked sweeps, trust in its store,
exits as events, fencing across boxes, metrics, its own log, scheduled restarts. Imports
quick and below."""
