"""Host memory between tensors and the engine: aligned (pinned, for CUDA)
buffers and pools, the device-copy interface (CUDA, and the simulated device
of the tests), and the snapshots that async, DCP and collective saves take."""
