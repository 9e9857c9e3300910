"""Model families. Each sub-package exports `SPEC: titanlite.model_spec.ModelSpec`."""
