"""The bottom layer: job specs, settings, the token record and small helpers. Imports nothing
else of the project, and no torch, so every layer and the client can build on it."""
