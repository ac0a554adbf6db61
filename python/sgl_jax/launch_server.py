"""``python -m sgl_jax.launch_server [--model-path PATH] [flags]``: start the OpenAI-compatible server.

Flags are the fields of `sgl_jax.srt.server_args.ServerArgs` (``--help`` lists them).
"""

import sys

from sgl_jax.srt.entrypoints.http_server import launch_server
from sgl_jax.srt.server_args import prepare_server_args


def main(argv=None) -> None:
    launch_server(prepare_server_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
