"""What every runner shares: the state dir's lock and doorbell, pid identity, the store
as the box sees it, wake-ups across boxes. Imports models and workflows only."""
