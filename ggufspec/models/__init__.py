"""Models on disk: the `models.toml` registry, Hub downloads (the one importer of `huggingface_hub`), the
offline mirror, the offload planner, tuning, and `resolve` (from what a user typed to files and a loaded Engine).
"""
