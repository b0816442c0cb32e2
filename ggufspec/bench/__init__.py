"""The with/without-draft benchmark: runs and rows, llama.cpp's reference programs, reports (the one importer
of `tabulate`), saved outputs and the prompt suites.
"""
