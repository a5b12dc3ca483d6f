"""Test helper: copy a GGUF with the project's own writer (stratatools.model.gguf_write), changing metadata values
or tensor shapes on the way (a tensor whose shape changes is written as zeros of its new size)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from stratatools.model import gguf_write as W
from stratatools.model.gguf import open_model

_ETYPE = {np.dtype(np.uint8): W.U8, np.dtype(np.int8): W.I8, np.dtype(np.uint16): W.U16, np.dtype(np.int16): W.I16,
          np.dtype(np.uint32): W.U32, np.dtype(np.int32): W.I32, np.dtype(np.float32): W.F32,
          np.dtype(np.bool_): W.BOOL, np.dtype(np.uint64): W.U64, np.dtype(np.int64): W.I64,
          np.dtype(np.float64): W.F64}


def copy_gguf(src: Path, dst: Path, kv: dict[str, Any] | None = None, ne: dict[str, tuple[int, ...]] | None = None,
              drop: tuple[str, ...] = ()) -> Path:
    """``src`` (one file) written again to ``dst``; ``kv``: key -> new value (an ARRAY keeps its element type;
    ``(value, vtype, etype)`` gives the types); ``ne``: tensor -> new shape; ``drop``: keys left out."""
    kv, ne = dict(kv or {}), dict(ne or {})
    with open_model(src) as m:
        f = m.files[0]
        w = W.GGUFWriterStream(dst, alignment=f.alignment)
        for k, v in f.kv.items():
            if k in drop:
                continue
            vtype, etype = f.kv_types[k], None
            if vtype == W.ARRAY:
                etype = W.STRING if isinstance(v, list) else _ETYPE[np.asarray(v).dtype]
            if k in kv:
                v = kv.pop(k)
                if isinstance(v, tuple):
                    v, vtype, etype = v
            if vtype == W.ARRAY and not isinstance(v, list):
                v = np.asarray(v).tolist()
            w.add(k, v, vtype, etype)
        for k, v in kv.items():
            w.add(k, *v) if isinstance(v, tuple) else w.add(k, v)
        for t in m.tensors.values():
            if t.name in ne:
                shape = tuple(ne.pop(t.name))
                w.add_tensor(t.name, shape, t.type, lambda n=t.type.nbytes(shape): [np.zeros(n, np.uint8)])
            else:
                w.add_tensor(t.name, t.ne, t.type, lambda t=t: [np.asarray(m.raw(t))])
        assert not ne, f"no such tensor(s): {list(ne)}"
        w.write()
    return dst
