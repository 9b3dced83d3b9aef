"""Client SDK: submit and follow jobs from a machine without GPUs (imports no torch)."""

from opentinker.client._http import AuthenticationError, GatewayError, InvalidJob, JobNotFound
from opentinker.client.scheduler import InferenceSchedulerClient, SchedulerClient
from opentinker.client.service import JobFailed, ServiceClient

__all__ = [
    "SchedulerClient", "ServiceClient", "InferenceSchedulerClient",
    "GatewayError", "AuthenticationError", "InvalidJob", "JobNotFound", "JobFailed",
]
