"""Start llama-cpp-python's OpenAI-compatible server with its weights in the plain CPU buffer.

Run with the interpreter of a separate virtual environment that has ``llama-cpp-python[server]`` (never
a dependency of sgl-jax); every argument goes to ``python -m llama_cpp.server``. On AMD EPYC CPUs with
AMX, llama.cpp's repacked (extra buffer type) matmul path crashed on the first completion here (llama.cpp
issue #20824); llama-cpp-python does not expose ``use_extra_bufts``, so this sets it to False in the
model parameters before the server loads the model.

    /path/to/llama-venv/bin/python benchmark/peers/llamacpp_server.py --model MODEL.gguf --port 8080 ...
"""

import llama_cpp.llama_cpp as llama_cpp_lib

_default_params = llama_cpp_lib.llama_model_default_params


def _params_without_extra_bufts():
    params = _default_params()
    params.use_extra_bufts = False
    return params


llama_cpp_lib.llama_model_default_params = _params_without_extra_bufts

if __name__ == "__main__":
    from llama_cpp.server.__main__ import main

    main()
