"""Leases: a host's ownership and fence, and placement across boxes. Imports base, builds."""
