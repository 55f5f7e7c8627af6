"""A host's life outside deploys: wake, stop, workers, operation-set members, the
ongoing health probe, takeover from a dead box. Imports the packages below it."""
