"""``python -m sgl_jax.launch_server [--model-path PATH] [flags]``: start the OpenAI-compatible server.

Flags are the fields of `sgl_jax.srt.server_args.ServerArgs` (``--help`` lists them). A server that cannot start
prints why (one line for a configuration error such as an unsupported architecture) and exits 1.
"""

import sys


def main(argv=None) -> None:
    # imported here, not at the top: the scheduler and detokenizer processes are spawned, and a spawned child
    # imports the parent's ``__main__`` module (this one) before it runs; at the top these imports made both
    # children load FastAPI, the HTTP routes and their protocol models for nothing
    from sgl_jax.srt.entrypoints.http_server import launch_server
    from sgl_jax.srt.errors import StartupError
    from sgl_jax.srt.server_args import prepare_server_args

    try:
        launch_server(prepare_server_args(sys.argv[1:] if argv is None else argv))
    except StartupError as e:
        sys.exit(f"sgl-jax: {e}")


if __name__ == "__main__":
    main()
