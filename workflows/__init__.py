"""The domain: transactional steps that advance rows (wake, stop, reap, release, recover),
the obligation registry and its pacing, and the named crash points. Talks to the outside
world only through workflows.base.ports; never imports runners."""
