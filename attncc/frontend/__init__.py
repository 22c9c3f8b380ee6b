"""Front end: spec text (parser) or decorated Python (decorator) -> a checked ir.Variant."""
