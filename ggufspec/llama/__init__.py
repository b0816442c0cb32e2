"""Everything that touches llama.cpp, and the only package that imports `llama_cpp`: the runtime (its backend,
log and stoppable loads), models and contexts, devices and their memory, the AMX route, RPC, quantizing, GGUF
headers (`gguf_info`, the one importer of `gguf`), measuring what a decode costs, and the pair check. Nothing
here imports the packages above it (engine, models, bench, cli).
"""
