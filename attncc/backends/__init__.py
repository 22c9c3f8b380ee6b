"""The backends: each one a folder holding its code generator and its templates."""
