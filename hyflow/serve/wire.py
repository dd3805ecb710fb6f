"""The Tinker wire formats `hyflow serve` reads and writes: its protobuf messages (from the `tinker` SDK's own
`tinker.proto.tinker_public_pb2`, the protocol's definition) for forward_backward requests and for the results of
forward_backward and sample; JSON (the SDK's pydantic types) for everything else.

Parsing never trusts the body: a malformed message, a tensor whose bytes do not fit its shape or dtype, an image
chunk (text models only) raise `ServeError` (a 400 naming the problem).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hyflow.serve.host import Datum, Sample, ServeError

_DTYPES = {"float32": np.float32, "int64": np.int64, "int32": np.int32}


def _pb():
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


def parse_forward_backward(body: bytes) -> tuple[str, int, str, dict, bool, list[Datum]]:
    """(model_id, seq_id, loss_fn, loss_fn_config, forward_only, data) of a protobuf ForwardBackwardRequest."""
    pb = _pb()
    message = pb.ForwardBackwardRequest()
    try:
        message.ParseFromString(body)
    except Exception as exc:  # google.protobuf.message.DecodeError and friends
        raise ServeError(f"forward_backward: the body is not a ForwardBackwardRequest protobuf ({exc})") from exc
    config: dict = {}
    for key, value in message.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    for key, value in message.loss_fn_config.items():
        config.setdefault(key, value)
    data = []
    for index, datum in enumerate(message.data):
        tokens: list[int] = []
        for chunk in datum.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise ServeError(f"datum {index}: a {kind!r} chunk; hyflow serve trains text models only (token "
                                 "chunks)")
            raw = chunk.encoded_text.tokens
            if len(raw) % 4:
                raise ServeError(f"datum {index}: token bytes are not int32 ({len(raw)} bytes)")
            tokens += np.frombuffer(raw, dtype=np.int32).tolist()
        if len(datum.model_input_spans) or len(datum.loss_fn_input_spans):
            raise ServeError(f"datum {index}: provenance spans (StableReinforce's recorded sampling) are not "
                             "supported by hyflow serve; send the datum without them")
        inputs = {name: tensor_from_proto(tensor, f"datum {index}: loss_fn_inputs[{name!r}]")
                  for name, tensor in datum.loss_fn_inputs.items()}
        data.append(Datum(tokens, inputs))
    return message.model_id, int(message.seq_id), message.loss_fn, config, bool(message.forward_only), data


def tensor_from_proto(message, where: str) -> torch.Tensor:
    pb = _pb()
    names = {pb.DTYPE_FLOAT32: "float32", pb.DTYPE_INT64: "int64", pb.DTYPE_INT32: "int32"}
    name = names.get(message.dtype)
    if name is None:
        raise ServeError(f"{where}: unsupported dtype {message.dtype} (float32 or int64)")
    if message.HasField("sparse_csr"):
        raise ServeError(f"{where}: sparse tensors are not supported; send a dense tensor")
    raw = message.dense
    itemsize = np.dtype(_DTYPES[name]).itemsize
    if len(raw) % itemsize:
        raise ServeError(f"{where}: {len(raw)} bytes is not a whole number of {name} values")
    array = np.frombuffer(raw, dtype=_DTYPES[name])
    shape = list(message.shape) or [array.size]
    if int(np.prod(shape)) != array.size:
        raise ServeError(f"{where}: shape {shape} does not hold {array.size} values")
    return torch.from_numpy(array.reshape(shape).copy())


def forward_backward_output(outputs: Sequence[dict[str, torch.Tensor]], metrics: dict[str, float]) -> bytes:
    """A protobuf ForwardBackwardOutput: one ArrayRecord, each field a BatchedTensor of all data (float32)."""
    pb = _pb()
    message = pb.ForwardBackwardOutput()
    message.loss_fn_output_type = "ArrayRecord"
    for key, value in metrics.items():
        message.metrics[key] = float(value)
    record = message.loss_fn_outputs.add()
    record.num_datums = len(outputs)
    for field in (outputs[0] if outputs else {}):
        arrays = [o[field].numpy().astype(np.float32).reshape(-1) for o in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        batched = record.fields[field]
        batched.dtype = pb.DTYPE_FLOAT32
        batched.data = b"".join(a.tobytes() for a in arrays)
        batched.offsets = offsets.tobytes()
    return message.SerializeToString()


def sample_output(samples: Sequence[Sample]) -> bytes:
    pb = _pb()
    message = pb.SampleResponse()
    for sample in samples:
        sequence = message.sequences.add()
        sequence.stop_reason = pb.STOP_REASON_STOP if sample.stop_reason == "stop" else pb.STOP_REASON_LENGTH
        sequence.tokens = np.asarray(sample.tokens, dtype=np.int32).tobytes()
        sequence.logprobs = np.asarray(sample.log_probs, dtype=np.float32).tobytes()
    return message.SerializeToString()
