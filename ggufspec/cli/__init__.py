"""The `ggufspec` command (the one importer of `click`): thin commands over the library, shared options, doctor.

Kept empty of imports: `entry` must be able to catch a Ctrl-C while the rest is imported.
"""
