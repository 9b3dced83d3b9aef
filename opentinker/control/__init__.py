"""The control plane: the embedded stack and its services, the scheduler (Prefect pools, slot
limits, deployments, job states), the operator's submission path, and the gateway tenants use."""
