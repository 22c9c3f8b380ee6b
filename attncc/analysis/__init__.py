"""Analysis: what the kernels may skip and how wide their integers must be (bounds,
intervals, ranges)."""
