"""A tensor a client sends in base64 (vLLM's image_embeds and prompt_embeds): the bytes of a ``torch.save``'d tensor,
unpickled weights-only as vLLM does, or of a ``.npy`` array, never with pickles. One dense tensor or a 400."""

from __future__ import annotations

import base64
import binascii
import io

from pdcluster.cluster.api.middleware import APIError

# Decoded. A LLaVA-NeXT image's embeddings in float32 (5 tiles of 576 rows, 4,096 wide) are 47 MiB; a 4,096-token
# prompt of a 4,096-wide model in float32 is 64 MiB.
MAX_TENSOR_BYTES = 64 * 1024 * 1024
NUMPY_MAGIC = b"\x93NUMPY"


def load_tensor(payload, field: str, where: str, param: str):
    """``payload`` (base64 of a tensor's bytes) as one dense CPU tensor; a 400 naming ``where`` otherwise, ``field``
    the request's name for the tensor, ``param`` the body field the error names."""
    import numpy as np
    import torch

    def bad(message: str) -> APIError:
        return APIError(400, f"{where}: {message}", param=param)

    if not isinstance(payload, str):
        raise bad(f"{field} must be one base64 string (a tensor's torch.save or .npy bytes)")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad(f"{field}' base64 does not decode") from None
    if len(data) > MAX_TENSOR_BYTES:
        raise bad(f"{field} hold {len(data)} bytes, more than {MAX_TENSOR_BYTES}")
    try:
        if data[:6] == NUMPY_MAGIC:
            tensor = torch.from_numpy(np.load(io.BytesIO(data)))  # allow_pickle is False by default: no object arrays
        else:
            tensor = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - any undecodable payload is the client's 400
        raise bad(f"{field} are neither torch.save'd tensor bytes nor a .npy array "
                  f"({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
        kind = type(tensor).__name__ if not isinstance(tensor, torch.Tensor) else f"a {tensor.layout} tensor"
        raise bad(f"{field} must hold one dense tensor, got {kind}")
    return tensor
