"""Deploy attempts: the request and driver, the steps every attempt shares, the overlap
and hold modes, scheduled restarts. Imports lifecycle and below."""
