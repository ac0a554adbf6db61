"""(the responses routes: being written, issue #36)"""

from __future__ import annotations

from sgl_jax.srt.entrypoints.routes.common import new_router

router = new_router()
