"""Notifications: the notifiers operators add (`notifiers`) and the drive that delivers each
event owed to one at least once, a try written before each send (`deliver`). The rows an
event owes are written by emit() itself (models/notices.py). Imports config and below."""
