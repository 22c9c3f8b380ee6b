"""Runtime: a compiled variant called on tensors: argument checks, backend and tile-config
choice, tuning, tile tables, the torch.library operator, packed sequences and decoding."""
