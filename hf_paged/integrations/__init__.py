"""transformers glue: attention/mask registration, the generate hook, the pipeline wrapper."""
