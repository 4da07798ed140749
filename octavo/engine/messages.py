"""How the protocol's messages (octavo/core/protocol.py) travel between the front-end process and
the engine-core process: msgpack via msgspec, typed on both ends, never pickle. The numpy arrays
inside outputs (TopLogprobs) are packed as (dtype, shape, bytes) and unpacked read-only with
np.frombuffer.
"""
from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from octavo.core.protocol import CoreInput, CoreOutputs


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return (obj.dtype.str, list(obj.shape), obj.tobytes())
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is np.ndarray:
        dtype, shape, data = obj
        return np.frombuffer(data, dtype=dtype).reshape(shape)
    raise NotImplementedError(f"cannot decode {kind}")


encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
input_decoder = msgspec.msgpack.Decoder(CoreInput)
output_decoder = msgspec.msgpack.Decoder(CoreOutputs, dec_hook=_dec_hook)
