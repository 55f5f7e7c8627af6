"""A host's life outside deploys: wake (and a wake that did not go through), stop, workers,
operation-set members, the ongoing health probe, takeover from a dead box. Imports the
packages below it."""
