"""gRPC GatewayControl: the scheduler pauses admission around weight pushes and resumes it with the
new weight version. Translates protos <-> Admission; status codes are set only here.
"""

from __future__ import annotations

import math

import grpc

from tether.gateway.admission import Admission
from tether.v1 import gateway_pb2, gateway_pb2_grpc, types_pb2

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["GatewayControl"].full_name


def admission_status(admission: Admission) -> gateway_pb2.AdmissionStatus:
    return gateway_pb2.AdmissionStatus(
        paused=admission.paused, in_flight=admission.in_flight, weight_version=admission.weight_version
    )


class GatewayControlServicer(gateway_pb2_grpc.GatewayControlServicer):
    def __init__(self, admission: Admission) -> None:
        self.admission = admission

    async def PauseAdmission(
        self, request: gateway_pb2.PauseAdmissionRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.AdmissionStatus:
        timeout = request.drain_timeout_s
        if not math.isfinite(timeout) or timeout < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "drain_timeout_s must be finite and >= 0")
        await self.admission.pause(timeout)
        # in_flight > 0 in the answer tells the caller the drain timed out.
        return admission_status(self.admission)

    async def ResumeAdmission(
        self, request: gateway_pb2.ResumeAdmissionRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.AdmissionStatus:
        if request.weight_version < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "weight_version must be >= 0")
        self.admission.resume(request.weight_version)
        return admission_status(self.admission)

    async def GetAdmission(
        self, request: types_pb2.Empty, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.AdmissionStatus:
        return admission_status(self.admission)
