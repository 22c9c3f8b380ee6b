"""The Gluon backend: Hopper (sm_90) kernels written in Gluon."""
