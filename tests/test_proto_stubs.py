"""The committed stubs in pagedserve/v1 are what grpcio-tools makes of proto/ today."""

from __future__ import annotations

from pathlib import Path


ROOT = Path(__file__).resolve().parents[1]


def test_generated_stubs_are_fresh(tmp_path):
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.proto"))
    assert protos, "no .proto files under proto/"
    args = ["protoc", f"-I{ROOT / 'proto'}", f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}", *protos]
    assert protoc.main(args) == 0
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert generated
    stale = [str(p) for p in generated if (ROOT / p).read_text() != (tmp_path / p).read_text()]
    assert not stale, f"stale stubs (run `make proto`): {stale}"


def test_stubs_import_and_round_trip():
    from pagedserve.v1 import serving_pb2, serving_pb2_grpc

    req = serving_pb2.GenerateRequest(text="hi", sampling=serving_pb2.SamplingParams(max_tokens=3, stop=["."]))
    back = serving_pb2.GenerateRequest.FromString(req.SerializeToString())
    assert back.WhichOneof("prompt") == "text" and back.sampling.max_tokens == 3
    assert not back.sampling.HasField("temperature")  # unset: the engine's default applies
    assert hasattr(serving_pb2_grpc, "ServingStub")
