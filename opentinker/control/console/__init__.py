"""The gateway's web console for tenants and the operator (see routes.py)."""
