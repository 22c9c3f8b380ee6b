"""Semantics: what a variant means, computed densely with PyTorch: the float64 reference
every kernel is held to, the language's arithmetic, dropout's and chance()'s bits."""
