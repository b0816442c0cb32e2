"""Everything that touches llama.cpp: the runtime (the one importer of `llama_cpp`), models and contexts,
devices and their memory, the AMX route, RPC, quantizing, GGUF headers (the one importer of `gguf`), measuring
what a decode costs, and the pair check. Nothing here imports the packages above it (models, bench, cli).
"""
