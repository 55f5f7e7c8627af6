"""Builds: staged builds (verification, references, garbage collection) and the failure
book that says what an attempt's end tells its rollout. Imports base."""
