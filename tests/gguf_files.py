"""GGUF files rewritten from others with the `gguf` package's own reader and writer (tests only): the stored tensor
bytes kept as they are, under another `general.architecture`, with some key/values or tensors replaced."""

import gguf
import numpy as np


def rewrite_gguf(src, dst, arch: str, *, copy_fields: bool = False, fields: dict | None = None,
                 replace: dict | None = None):
    """src's tensors (stored bytes as they are) under `arch`. `copy_fields`: its key/values too, those named in
    `fields` replaced; `replace` swaps a tensor for another array."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, arch)
    for key, field in reader.fields.items() if copy_fields else ():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = (fields or {}).get(key, field.contents())
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, field.types[0], sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, field.types[0])
    for t in reader.tensors:
        if replace and t.name in replace:
            writer.add_tensor(t.name, replace[t.name])
            continue
        raw = None if t.tensor_type.name in ("F32", "F16") else t.tensor_type
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
