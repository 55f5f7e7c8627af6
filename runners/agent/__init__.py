"""The agent daemon: its loop and reconciler, exits as events, fencing across boxes,
metrics, sd_notify, its own log, scheduled restarts. Imports quick and below."""
