"""The torch.save format's writer and reader (records, read-behind, device
routing), over the engine and the staging pool."""
