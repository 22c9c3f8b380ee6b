"""Integrations of attncc kernels into other libraries (optional dependencies).

- `attncc.integrations.transformers`: Hugging Face transformers' attention registry
  (`pip install attncc[hf]`).
"""
