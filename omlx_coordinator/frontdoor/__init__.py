"""Who may ask for what: keys, roles, quotas, usage, the access log."""
