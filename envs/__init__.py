"""Shipped environments: math (strict answer format), toy (pipeline smoke test)."""
