"""A GGUF file in another quantization, made by llama.cpp's own quantizer (`llama_model_quantize`).

For registry models that the offline mirror does not carry but can derive: the Q8_0 target of the
CPU pair is made from the Q4_K_M file the mirror does carry. Requantizing keeps the Q4_K_M's
rounding (the weights are those of the Q4_K_M, stored at 8 bits), so a derived file is not the
Hub's file of the same name: it is what this machine's llama.cpp makes from the base, written to a
hidden partial file, checked (its header parses, its file type is the one asked for, it has the
base's tensors) and only then renamed into place.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import GGUFSpecError
from .gguf_info import read_info


def ftype_code(quant: str) -> int:
    """llama.cpp's file-type code for a quantization name such as Q8_0 or Q4_0."""
    import llama_cpp

    code = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant.upper()}", None)
    if code is None:
        raise GGUFSpecError(f"quantization {quant!r} is not one llama.cpp can write; try Q8_0, Q4_0 or Q4_K_M")
    return int(code)


def quantize(base: Path, dest: Path, quant: str, *, threads: int | None = None) -> Path:
    """Write `base` quantized as `quant` to `dest` atomically; check what was made. Returns dest."""
    import llama_cpp

    from .backend import init

    init()  # llama.cpp's log (a line per tensor) goes through ggufspec's: shown with --verbose
    code = ftype_code(quant)
    source = read_info(base)
    partial = dest.with_name(f".{dest.name}.partial")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = code
    params.allow_requantize = True  # the base is itself quantized
    params.nthread = threads or os.cpu_count() or 1
    try:
        rc = llama_cpp.llama_model_quantize(os.fsencode(base), os.fsencode(partial), params)
        if rc != 0:
            raise GGUFSpecError(f"{base.name}: llama.cpp's quantizer failed to write {quant} (code {rc}); nothing was written")
        made = read_info(partial)
        if made.file_type != quant.upper() or len(made.tensors) != len(source.tensors):
            raise GGUFSpecError(f"{base.name}: the {quant} file made from it reads as {made.file_type} with "
                                f"{len(made.tensors)} tensors (the base has {len(source.tensors)}); nothing was written")
        os.replace(partial, dest)
    finally:
        partial.unlink(missing_ok=True)
    return dest
