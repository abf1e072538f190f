"""The file formats, as bytes in and plans out (no I/O): zip records and their
layout, torch's serialization rules, the pickler and the restricted unpickler,
the safetensors header, DCP's records."""
