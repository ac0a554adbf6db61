"""Run at start-up by every server process the tests launch (srt_helpers.server_env puts this folder first on
PYTHONPATH): the process sees the packages as the runtime installs them, without torch.

torch is a test extra, for the transformers references computed in the pytest process. When it is
installed, transformers imports it (~2.5 s) as soon as a server process loads a model config or tokenizer,
in each of a server's three processes. `sys.modules["torch"] = None` makes `import torch` fail and
`importlib.util.find_spec("torch")` answer None, so transformers takes torch to be absent, as it is in a
runtime-only install (test_runtime_install.py checks that one).

This file shadows any other sitecustomize module on the path (a Python distribution's own), in these
processes only.
"""

import sys

sys.modules.setdefault("torch", None)
