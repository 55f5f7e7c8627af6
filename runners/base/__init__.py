"""What every runner shares: the state dir's lock and doorbell, pid identity, the store
as the box sees it, wake-ups across boxes, sd_notify's both ends. Imports models and
workflows only."""
