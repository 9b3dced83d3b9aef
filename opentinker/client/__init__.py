"""Client SDK: submit and follow jobs from a machine without GPUs (imports no torch)."""

from opentinker.client.http import AuthenticationError, GatewayError, GatewayUnreachable, InvalidJob, JobFailed, JobNotFound
from opentinker.client.link import LinkRefused
from opentinker.client.scheduler import InferenceSchedulerClient, SchedulerClient
from opentinker.client.service import LinkLost, ServiceClient

__all__ = [
    "SchedulerClient", "ServiceClient", "InferenceSchedulerClient",
    "GatewayError", "GatewayUnreachable", "AuthenticationError", "InvalidJob", "JobNotFound", "JobFailed",
    "LinkRefused", "LinkLost",
]
