"""The generated gRPC package must match protos/ exactly."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_generated_protos_are_fresh():
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--check"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_services_share_one_contract():
    from tether.v1 import gateway_pb2, inference_pb2, merger_pb2, scheduler_pb2, trainer_pb2

    names = {
        m.DESCRIPTOR.package for m in (gateway_pb2, inference_pb2, merger_pb2, scheduler_pb2, trainer_pb2)
    }
    assert names == {"tether.v1"}
