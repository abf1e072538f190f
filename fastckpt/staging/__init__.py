"""Host memory between tensors and the engine: the device-copy interface and
its host buffers and pools (``device``), the one snapshot component that
async, DCP and collective saves take their copies with (``snapshot``),
streaming device bytes to the host (``tohost``) and file ranges to devices
(``todevice``), and DCP's state-dict staging (``statedict``)."""
