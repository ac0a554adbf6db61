"""Offline Engine: the same scheduler and detokenizer processes as the server, without HTTP.

    from sgl_jax import Engine
    with Engine(max_total_tokens=8192) as engine:
        out = engine.generate("The capital of France is", {"max_new_tokens": 8, "temperature": 0})

The TokenizerManager lives on a private asyncio loop in a background thread, so `generate` works from
plain code and `async_generate` from any event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, AsyncIterator, Dict, Iterator, List, Optional, Union

import ml_dtypes
import numpy as np
import pydantic

from sgl_jax.srt.entrypoints.launch import ChildWatcher, launch_with_tokenizer, log_ready, stop_subprocesses
from sgl_jax.srt.entrypoints.native_protocol import (
    GenerateRequest,
    OpenSessionRequest,
    ScoreRequest,
    validation_message,
)
from sgl_jax.srt.errors import RequestError
from sgl_jax.srt.entrypoints.control_protocol import (
    MemoryOccupationRequest,
    PauseGenerationRequest,
    StartProfileRequest,
    UpdateWeightsFromDiskRequest,
)
from sgl_jax.srt.io_struct import (
    GetWeightsByNameReqInput,
    LoadLoRAAdapterReqInput,
    PauseGenerationReqInput,
    ProfileReqInput,
    UnloadLoRAAdapterReqInput,
    UpdateWeightsFromTensorReqInput,
)
from sgl_jax.srt.tokenizer.tokenizer_manager import TokenizerManager
from sgl_jax.srt.server_args import ServerArgs
from sgl_jax.srt.startup_phases import StartupPhases
from sgl_jax.srt.utils import configure_logging

logger = logging.getLogger(__name__)


def _validated(model, body: dict):
    """Validate `body` with the HTTP API's pydantic model (the same checks as the server).

    Raises:
        RequestError: 400 naming the bad fields.
    """
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as e:
        raise RequestError(validation_message(e.errors())) from None


def _split(body: dict):
    return _validated(GenerateRequest, body).to_inputs()


def _score_input(**fields):
    return _validated(ScoreRequest, {k: v for k, v in fields.items() if v is not None}).to_input()


def host_array(t) -> np.ndarray:
    """A host (numpy) copy of array `t`: numpy, JAX (gathered from its devices) or torch (bfloat16 through
    float32, then back to ml_dtypes' bfloat16)."""
    if hasattr(t, "detach") and hasattr(t, "cpu"):  # a torch tensor (torch is not imported here)
        t = t.detach().cpu()
        if str(t.dtype) == "torch.bfloat16":
            return t.float().numpy().astype(ml_dtypes.bfloat16)
        return t.numpy()
    return np.asarray(t)


async def _anext(agen):
    return await agen.__anext__()


async def _aclose(agen):
    await agen.aclose()


class Engine:
    """Start the engine processes in-process (no HTTP).

    Args:
        **kwargs: any `ServerArgs` field (e.g. ``model_path``, ``max_total_tokens``, ``dtype``).
    Raises:
        RuntimeError: the scheduler failed to start (its traceback is in the message).
    """

    def __init__(self, **kwargs):
        phases = StartupPhases()  # the engine's start-up, from this call
        self.server_args = ServerArgs(**kwargs)
        if not logging.getLogger().handlers:
            configure_logging(self.server_args.log_level, "Engine")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="sgl-jax-engine")
        self._thread.start()
        self._procs = []
        self._closed = False
        self._port_args = None
        port_args, self.scheduler_info, self._procs, tokenizer = launch_with_tokenizer(self.server_args, phases)
        self._port_args = port_args
        try:
            with phases.phase("tokenizer manager"):
                self.tokenizer_manager: TokenizerManager = self._run(self._create_tm(port_args, tokenizer))
        except BaseException:
            self.shutdown()
            raise
        self._watcher = ChildWatcher(self._procs, self._on_child_death)
        log_ready(self.scheduler_info, phases)

    async def _create_tm(self, port_args, tokenizer) -> TokenizerManager:
        tm = TokenizerManager(self.server_args, port_args, self.scheduler_info, tokenizer=tokenizer)
        tm.start()
        return tm

    def _on_child_death(self, name: str, exitcode: int) -> None:
        logger.error("%s exited unexpectedly with code %s; the engine is unusable", name, exitcode)
        self._loop.call_soon_threadsafe(self.tokenizer_manager.mark_dead, f"{name} exited with code {exitcode}")

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @staticmethod
    def _body(prompt, sampling_params, input_ids, return_logprob, logprob_start_len, top_logprobs_num,
              token_ids_logprob, return_text_in_logprobs, stream, rid, session_params=None,
              return_routed_experts=None, lora_path=None) -> Dict[str, Any]:
        body: Dict[str, Any] = {"sampling_params": sampling_params, "return_logprob": return_logprob,
                                "return_text_in_logprobs": return_text_in_logprobs, "stream": stream}
        if prompt is not None:
            body["text"] = prompt
        if input_ids is not None:
            body["input_ids"] = input_ids
        for k, v in (("logprob_start_len", logprob_start_len), ("top_logprobs_num", top_logprobs_num),
                     ("token_ids_logprob", token_ids_logprob), ("rid", rid), ("session_params", session_params),
                     ("return_routed_experts", return_routed_experts), ("lora_path", lora_path)):
            if v is not None:
                body[k] = v
        return body

    async def _generate_all(self, objs) -> List[dict]:
        return await asyncio.gather(*(self.tokenizer_manager.generate(o) for o in objs))

    def generate(
        self,
        prompt: Optional[Union[str, List[str]]] = None,
        sampling_params: Optional[Union[dict, List[dict]]] = None,
        input_ids: Optional[Union[List[int], List[List[int]]]] = None,
        return_logprob: Union[bool, List[bool]] = False,
        logprob_start_len: Optional[Union[int, List[int]]] = None,
        top_logprobs_num: Optional[Union[int, List[int]]] = None,
        token_ids_logprob: Optional[list] = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: Optional[Union[str, List[str]]] = None,
        session_params: Optional[dict] = None,
        return_routed_experts: Optional[Union[bool, List[bool]]] = None,
        lora_path: Optional[Union[str, List[Optional[str]]]] = None,
    ) -> Union[dict, List[dict], Iterator[dict]]:
        """Generate for one prompt (returns a dict) or a batch (a list of dicts), like SGLang's Engine.

        The dicts are the same as the HTTP /generate responses (``text``, ``output_ids``, ``meta_info``).
        With ``stream=True`` (single prompt) returns an iterator of such dicts. ``session_params``: SGLang's
        ``{"id", "rid", "offset", "replace", "drop_previous_output"}`` (see `open_session`).
        ``return_routed_experts``: SGLang's; ``meta_info["routed_experts"]`` is then the base64 of int32
        [output tokens, layers, top-k] (needs ``enable_return_routed_experts=True`` and a MoE model).
        ``lora_path``: a loaded LoRA adapter's name, or one per prompt (None: the base model; docs/lora.md).
        Raises:
            RequestError: an invalid request.
        """
        obj = _split(self._body(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                                     top_logprobs_num, token_ids_logprob, return_text_in_logprobs, stream, rid,
                                     session_params, return_routed_experts, lora_path))
        if isinstance(obj, list):
            return self._run(self._generate_all(obj))
        if stream:
            return self._stream_sync(obj)
        return self._run(self.tokenizer_manager.generate(obj))

    def _stream_sync(self, obj) -> Iterator[dict]:
        agen = self.tokenizer_manager.generate_request(obj)
        try:
            while True:
                try:
                    yield self._run(_anext(agen))
                except StopAsyncIteration:
                    return
        finally:
            self._run(_aclose(agen))

    def score(self, query=None, items=None, label_token_ids=None, apply_softmax: bool = False,
              item_first: bool = False, algorithm: Optional[str] = None) -> List[List[float]]:
        """Score items against a query (SGLang's Engine.score): per item, the probability of each label
        token as the next token after query + item (see tokenizer/score_request.py).

        Args:
            query: text or token ids; items: list of texts or of token-id lists (same kind as query).
            label_token_ids: token ids to score. apply_softmax: softmax over the labels instead of their
                full-vocabulary probabilities. item_first: item before query. algorithm: force
                serial | packed | prefill_extend (default: the server's --multi-item-algorithm).
        Returns:
            [[float per label] per item].
        Raises:
            RequestError: an invalid request (400) or one that cannot fit (413).
        """
        obj = _score_input(query=query, items=items, label_token_ids=label_token_ids, apply_softmax=apply_softmax,
                           item_first=item_first, algorithm=algorithm)
        return self._run(self.tokenizer_manager.score_request(obj))["scores"]

    async def async_score(self, query=None, items=None, label_token_ids=None, apply_softmax: bool = False,
                          item_first: bool = False, algorithm: Optional[str] = None) -> List[List[float]]:
        """Async `score`, usable from any event loop."""
        obj = _score_input(query=query, items=items, label_token_ids=label_token_ids, apply_softmax=apply_softmax,
                           item_first=item_first, algorithm=algorithm)
        coro = self.tokenizer_manager.score_request(obj)
        out = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))
        return out["scores"]

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                             logprob_start_len=None, top_logprobs_num=None, token_ids_logprob=None,
                             return_text_in_logprobs=False, stream=False, rid=None, session_params=None,
                             return_routed_experts=None) -> Union[dict, List[dict], AsyncIterator[dict]]:
        """Async `generate`, usable from any event loop. With ``stream=True`` returns an async iterator."""
        obj = _split(self._body(prompt, sampling_params, input_ids, return_logprob, logprob_start_len,
                                     top_logprobs_num, token_ids_logprob, return_text_in_logprobs, stream, rid,
                                     session_params, return_routed_experts))
        if stream and not isinstance(obj, list):
            return self._stream_async(obj)
        coro = self._generate_all(obj) if isinstance(obj, list) else self.tokenizer_manager.generate(obj)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def _stream_async(self, obj) -> AsyncIterator[dict]:
        agen = self.tokenizer_manager.generate_request(obj)
        try:
            while True:
                fut = asyncio.run_coroutine_threadsafe(_anext(agen), self._loop)
                try:
                    yield await asyncio.wrap_future(fut)
                except StopAsyncIteration:
                    return
        finally:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_aclose(agen), self._loop))

    def get_server_info(self) -> dict:
        """The server's flags, ``scheduler_info`` (`SchedulerInfo.to_json`) and per-rank ``internal_states``, as
        /get_server_info gives them."""
        return {"internal_states": self._run(self.tokenizer_manager.get_internal_state())["dp_ranks"],
                "scheduler_info": self.scheduler_info.to_json(), **self.server_args.__dict__}

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> dict:
        """SGLang's Engine.load_lora_adapter: register a PEFT adapter (directory or hub id); returns
        ``{"success", "error_message", "loaded_adapters"}`` as /load_lora_adapter answers."""
        out = self._run(self.tokenizer_manager.update_lora(LoadLoRAAdapterReqInput(lora_name, lora_path, pinned)))
        return {"success": out.success, "error_message": out.error_message, "loaded_adapters": out.loaded_adapters}

    def unload_lora_adapter(self, lora_name: str) -> dict:
        """SGLang's Engine.unload_lora_adapter (see `load_lora_adapter`; fails while requests use it)."""
        out = self._run(self.tokenizer_manager.update_lora(UnloadLoRAAdapterReqInput(lora_name)))
        return {"success": out.success, "error_message": out.error_message, "loaded_adapters": out.loaded_adapters}

    def flush_cache(self):
        return self._run(self.tokenizer_manager.flush_cache())

    # ---- RL and operator control (scheduler/engine_control.py; the HTTP routes' semantics)
    def _control(self, obj):
        return self._run(self.tokenizer_manager.control(obj))

    def update_weights_from_disk(self, model_path: str, load_format: Optional[str] = None,
                                 abort_all_requests: bool = False, weight_version: Optional[str] = None,
                                 revision: Optional[str] = None) -> tuple:
        """SGLang's Engine.update_weights_from_disk: ``(success, message, num_paused_requests)``."""
        body = _validated(UpdateWeightsFromDiskRequest, {
            "model_path": model_path, "load_format": load_format, "abort_all_requests": abort_all_requests,
            "weight_version": weight_version, "revision": revision})
        out = self._control(body.to_input())
        return out.success, out.message, out.data.get("num_paused_requests", 0)

    def update_weights_from_tensor(self, named_tensors, load_format: Optional[str] = None, flush_cache: bool = True,
                                   abort_all_requests: bool = False, weight_version: Optional[str] = None) -> tuple:
        """SGLang's Engine.update_weights_from_tensor: `named_tensors` are (HF parameter name, array) pairs --
        numpy, JAX (on any device) or torch arrays, in the checkpoint's layout -- copied to the host and placed
        into the served parameters' shardings as the loader places a checkpoint (no compile). Returns
        ``(success, message)``; a name the model does not have or a wrong shape fails it (nothing replaced).
        `load_format` and `flush_cache` are accepted for SGLang's signature (the prefix cache is always retired)."""
        tensors = [(str(name), host_array(t)) for name, t in named_tensors]
        out = self._control(UpdateWeightsFromTensorReqInput(tensors, abort_all_requests, weight_version))
        return out.success, out.message

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """SGLang's Engine.get_weights_by_name: the first `truncate_size` rows of parameter `name` (nested lists).

        Raises:
            RequestError: 400 for a name the model does not have, 409 while the weights are released.
        """
        out = self._control(GetWeightsByNameReqInput(name, truncate_size))
        if not out.success:
            raise RequestError(out.message, out.status_code)
        return out.data["parameter"]

    def release_memory_occupation(self, tags: Optional[List[str]] = None) -> dict:
        """Free the KV buffers and/or the weights on the devices (tags "kv_cache", "weights"; None: both)."""
        return self._memory(tags, release=True)

    def resume_memory_occupation(self, tags: Optional[List[str]] = None) -> dict:
        """Restore what `release_memory_occupation` freed."""
        return self._memory(tags, release=False)

    def _memory(self, tags, release: bool) -> dict:
        body = _validated(MemoryOccupationRequest, {} if tags is None else {"tags": list(tags)})
        out = self._control(body.to_input(release))
        return {"success": out.success, "message": out.message, **out.data}

    def pause_generation(self, mode: str = "abort") -> dict:
        """Pause: ``abort``, ``retract`` or ``in_place`` (see /pause_generation)."""
        out = self._control(_validated(PauseGenerationRequest, {"mode": mode}).to_input())
        return {"success": out.success, "message": out.message}

    def continue_generation(self) -> dict:
        out = self._control(PauseGenerationReqInput(resume=True))
        return {"success": out.success, "message": out.message}

    def start_profile(self, output_dir: Optional[str] = None, num_steps: Optional[int] = None,
                      duration_s: Optional[float] = None, **sglang_fields) -> dict:
        """Start a jax.profiler trace under --profile-dir (see /start_profile). `sglang_fields`: the rest of SGLang's
        ProfileReqInput (``start_step``, ``activities``, ``with_stack``, ``record_shapes``, ``profile_by_stage``,
        ``merge_profiles``, ``profile_prefix``, ...), accepted and ignored as by /start_profile.

        Raises:
            RequestError: 400 -- an unknown keyword or a bad value (naming it)."""
        fields = {"output_dir": output_dir, "num_steps": num_steps, "duration_s": duration_s, **sglang_fields}
        body = _validated(StartProfileRequest, {k: v for k, v in fields.items() if v is not None})
        out = self._control(body.to_input())
        return {"success": out.success, "message": out.message, **out.data}

    def stop_profile(self) -> dict:
        out = self._control(ProfileReqInput(start=False))
        return {"success": out.success, "message": out.message, **out.data}

    def open_session(self, capacity_of_str_len: int = 0, session_id: Optional[str] = None,
                     streaming: bool = False, timeout: Optional[float] = None) -> str:
        """Open a session (SGLang's Engine.open_session); returns its id. Its turns pass
        ``session_params={"id": ..., "rid": ...}`` to `generate` (scheduler/sessions.py).

        Raises:
            RequestError: 400 -- the id is taken, streaming without --enable-streaming-session (upstream
                returns None instead), or no room for another streaming session.
        """
        body = _validated(OpenSessionRequest, {"capacity_of_str_len": capacity_of_str_len, "session_id": session_id,
                                               "streaming": streaming, "timeout": timeout})
        return self._run(self.tokenizer_manager.open_session(body.to_input()))

    def close_session(self, session_id: str) -> None:
        """Close a session, releasing what it holds (now, or when its running turn finishes).

        Raises:
            RequestError: 404 -- no open session has that id.
        """
        self._run(self.tokenizer_manager.close_session(session_id))

    def shutdown(self) -> None:
        """Stop the child processes and the background loop. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if getattr(self, "_watcher", None) is not None:
            self._watcher.stop()
        stop_subprocesses(self._procs, getattr(self, "_port_args", None))
        tm = getattr(self, "tokenizer_manager", None)
        if tm is not None and self._thread.is_alive():
            self._run(tm.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass
