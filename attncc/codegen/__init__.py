"""Code generation: a Variant and its analysis -> one standalone Python module of Triton
kernels (portable), its decoding part (decode), or Gluon kernels for Hopper (gluon); the
names such a module must define are declared in interface."""
