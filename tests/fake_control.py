"""Plain-Python stand-ins for the Inference, Trainer and GatewayControl gRPC stubs the scheduler calls
(tether.scheduler.publish, tether.scheduler.run): each keeps the state its real counterpart reports
and logs every call, and can be told to fail like the real one does (with a grpc.aio.AioRpcError)."""

from __future__ import annotations

import grpc

from tether.v1 import gateway_pb2, inference_pb2, trainer_pb2, types_pb2


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class FakeInference:
    """The inference adapter in front of vLLM: the version it serves, the checkpoint it vouches for
    ("" after a path-2 push: it loaded nothing itself), and whether generation is paused or asleep."""

    def __init__(self, version: int = 0, checkpoint_dir: str = "") -> None:
        self.version, self.checkpoint_dir = version, checkpoint_dir
        self.paused = self.asleep = False
        self.partial = False  # holds part of a failed path-2 push (its version label unchanged)
        self.log: list[str] = []
        self.fail_load: set[str] = set()  # checkpoints whose LoadWeights fails
        self.report_version: int | None = None  # LoadWeights answers this version instead

    async def Pause(self, req: inference_pb2.PauseRequest) -> types_pb2.Empty:
        self.log.append(f"pause:{req.mode}")
        self.paused = True
        return types_pb2.Empty()

    async def Resume(self, req: types_pb2.Empty) -> types_pb2.Empty:
        self.log.append("resume")
        self.paused = False
        return types_pb2.Empty()

    async def GetWeightVersion(self, req: types_pb2.Empty) -> inference_pb2.WeightVersion:
        self.log.append("version")
        return inference_pb2.WeightVersion(version=self.version, checkpoint_dir=self.checkpoint_dir)

    async def LoadWeights(self, req: inference_pb2.LoadWeightsRequest) -> inference_pb2.WeightVersion:
        """Path 1: reload the checkpoint as a whole, then resume generation (as the adapter does)."""
        self.log.append(f"load:{req.checkpoint_dir}:{req.version}")
        if req.checkpoint_dir in self.fail_load:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"weight load failed: {req.checkpoint_dir}")
        self.version, self.checkpoint_dir = req.version, req.checkpoint_dir
        self.paused = self.partial = False
        version = req.version if self.report_version is None else self.report_version
        return inference_pb2.WeightVersion(version=version, checkpoint_dir=req.checkpoint_dir)

    async def Sleep(self, req: inference_pb2.SleepRequest) -> types_pb2.Empty:
        self.log.append(f"sleep:{req.level}")
        self.asleep = True
        return types_pb2.Empty()

    async def WakeUp(self, req: types_pb2.Empty) -> types_pb2.Empty:
        self.log.append("wake")
        self.asleep = False
        return types_pb2.Empty()


class FakeTrainer:
    """The trainer: its newest version and checkpoint (GetStatus); PushWeights streams that version
    into `inference` (path 2), or fails (`fail_push`), or ends without vLLM taking it (`lose_push`)."""

    def __init__(self, inference: FakeInference, version: int = 0, checkpoint_dir: str = "") -> None:
        self.inference = inference
        self.version, self.checkpoint_dir = version, checkpoint_dir
        self.fail_push: grpc.aio.AioRpcError | None = None
        self.lose_push = False
        self.records: dict[int, tuple[int, str]] = {}  # step -> (version, checkpoint)
        self.log: list[str] = []
        self.intended: list[int] = []  # each TrainStep's intended_groups

    async def TrainStep(self, req: trainer_pb2.TrainStepRequest) -> trainer_pb2.TrainStepResponse:
        """A new version and its checkpoint; a step trained before is answered from its record."""
        self.log.append(f"train:{req.step}:{','.join(req.group_ids)}")
        self.intended.append(req.intended_groups)
        if req.step not in self.records:
            self.version += 1
            self.checkpoint_dir = f"/ckpt/v{self.version}"
            self.records[req.step] = (self.version, self.checkpoint_dir)
        version, ckpt = self.records[req.step]
        return trainer_pb2.TrainStepResponse(step=req.step, weight_version=version, checkpoint_dir=ckpt)

    async def GetStatus(self, req: types_pb2.Empty) -> trainer_pb2.TrainerStatus:
        self.log.append("status")
        return trainer_pb2.TrainerStatus(weight_version=self.version, checkpoint_dir=self.checkpoint_dir)

    async def PushWeights(self, req: trainer_pb2.PushWeightsRequest) -> trainer_pb2.PushWeightsResponse:
        self.log.append(f"push:{req.version}")
        assert self.inference.paused, "path 2 runs while generation is paused"
        if self.fail_push is not None:
            self.inference.partial = True
            raise self.fail_push
        if not self.lose_push:
            self.inference.version, self.inference.checkpoint_dir = req.version, ""
        return trainer_pb2.PushWeightsResponse(version=req.version)


class FakeGateway:
    def __init__(self) -> None:
        self.log: list[str] = []

    async def PauseAdmission(self, req: gateway_pb2.PauseAdmissionRequest) -> gateway_pb2.AdmissionStatus:
        self.log.append("pause")
        return gateway_pb2.AdmissionStatus()

    async def ResumeAdmission(self, req: gateway_pb2.ResumeAdmissionRequest) -> gateway_pb2.AdmissionStatus:
        self.log.append(f"resume:{req.weight_version}")
        return gateway_pb2.AdmissionStatus()
