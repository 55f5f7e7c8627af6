"""What every workflow step stands on: the Context and the ports it is handed, crash
points, the step classifier, pacing, lookups, state-dir paths, the queue of wakes.
Imports models only (no other workflow package)."""
