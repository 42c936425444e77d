"""Engine wiring: the one runtime module that builds every part of an engine.

:func:`build_engine` loads the model and tokenizer and assembles the model runner, the grammar
backend (and its mask worker pool), the drafter and the scheduler; :class:`EngineParts` holds
them. It is the only runtime module besides :mod:`structspec.scheduler` that imports the
grammar, speculative, runner and scheduler packages together (docs/architecture.md, "Package
map"). :class:`~structspec.engine.llm_engine.LLMEngine` runs the request-level loop over the
parts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from structspec.config import EngineConfig, ModelConfig, check_max_model_len, resolve_engine_config
from structspec.engine.cpu_threads import set_cpu_threads, set_gpu_host_threads
from structspec.grammar.backend import GrammarBackend
from structspec.grammar.llg_backend import LlgBackend
from structspec.grammar.select_backend import SelectingBackend
from structspec.grammar.worker_pool import MaskWorkerPool, default_spin_ms
from structspec.models.default_model import resolve_model_path
from structspec.models.loader import load_model, load_model_config
from structspec.models.quantize import plan_for, quantize_model
from structspec.models.tokenizer import Tokenizer
from structspec.runner.cuda_graph import graph_batch_sizes
from structspec.runner.model_runner import ModelRunner
from structspec.scheduler.scheduler import Scheduler
from structspec.speculative.base import Drafter
from structspec.speculative.registry import create_drafter

logger = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """Everything an engine runs on, built by :func:`build_engine`.

    Attributes:
        config: the resolved engine config ("auto" fields filled in).
        model_path: the model directory.
        max_model_len: the context a request may use (prompt + new tokens), lowered to what
            the KV cache holds with one draft tree.
        model_config: the target's architecture.
        tokenizer: the model's tokenizer.
        runner: the target model runner (owns the KV pool).
        grammar: the grammar backend of ``config.grammar.backend`` (the scheduler's grammar
            service owns it).
        drafter: the speculative drafter.
        scheduler: the scheduler over all of them.
    """

    config: EngineConfig
    model_path: str
    max_model_len: int
    model_config: ModelConfig
    tokenizer: Tokenizer
    runner: ModelRunner
    grammar: GrammarBackend | SelectingBackend
    drafter: Drafter
    scheduler: Scheduler


def build_engine(config: EngineConfig) -> EngineParts:
    """Load the model, tokenizer, grammar backend and drafter; build the scheduler.

    Args:
        config: engine configuration ("auto" fields are resolved here). With
            ``load_format="dummy"`` the target (and a ``draft_model`` drafter's model) get
            seeded random weights (seed ``config.seed``) built on the device from config.json.

    Raises:
        FileNotFoundError / ValueError: on a bad model path or config, naming what is wrong
            (e.g. a ``max_model_len`` above the model's context length, with both numbers:
            :func:`structspec.config.check_max_model_len`), or a KV cache too small for one
            request with its draft tree.
    """
    config = resolve_engine_config(config)
    if config.torch_device.type == "cpu":
        # Activations of these models underflow into float32 denormals, which x86 cores
        # process ~20x slower (measured: a 120-token SmolLM2 forward takes 3.1 s with
        # denormals, 0.15 s flushed). Flushing them to zero changes logits by < 1e-30.
        # NOTE: the flag is per thread and threads inherit it when created, so it is set
        # before the first torch op spawns the OpenMP pool.
        torch.set_flush_denormal(True)
        set_cpu_threads()
    else:
        set_gpu_host_threads()
    model_path = resolve_model_path(config.model)
    # From config.json alone: a context the model does not have fails before the weights load.
    max_model_len = check_max_model_len(
        config.max_model_len, load_model_config(model_path).max_position_embeddings)
    device, dtype = config.torch_device, config.torch_dtype
    torch.manual_seed(config.seed)
    model, model_config = load_model(model_path, device=device, dtype=dtype,
                                     load_format=config.load_format, seed=config.seed)
    plan = plan_for(config.quantization)
    if plan is not None:  # weight-only int8/int4 linears (CPU), from the loaded float32 weights
        quantize_model(model, plan)
    tokenizer = Tokenizer(model_path, chat_template=config.chat_template)
    runner = ModelRunner(model, model_config, config.cache, device=device, dtype=dtype,
                         use_cuda_graph=config.cuda_graph,
                         cuda_graph_batch_sizes=graph_batch_sizes(
                             config.scheduler.max_batch_size),
                         max_model_len=max_model_len + config.spec.tree_size,
                         kernels=config.kernels, batch_invariant=config.batch_invariant)
    max_model_len = _fit_to_kv(runner, config, max_model_len)
    grammar = _grammar_backend(config, tokenizer.hf, vocab_size=model_config.vocab_size,
                               stop_token_ids=list(tokenizer.eos_token_ids))
    drafter = create_drafter(config.spec, target=runner, device=device, dtype=dtype,
                             max_batch_size=config.scheduler.max_batch_size,
                             load_format=config.load_format, seed=config.seed)
    mask_pool = None
    if config.grammar.mask_build_workers > 0:
        llg = grammar.llguidance if isinstance(grammar, SelectingBackend) else None
        mask_pool = MaskWorkerPool(
            grammar.tokenizer_info, num_workers=config.grammar.mask_build_workers,
            vocab_size=model_config.vocab_size,
            max_rows=config.scheduler.max_batch_size * drafter.num_nodes,
            stop_token_ids=list(tokenizer.eos_token_ids), pin=device.type == "cuda",
            llguidance_tokenizer=None if llg is None else llg.tokenizer_source,
            max_rollback_tokens=config.grammar.max_rollback_tokens,
            spin_ms=default_spin_ms(config.grammar.mask_build_workers,
                                    gpu_engine=device.type == "cuda"))
    scheduler = Scheduler(config, runner, grammar, drafter, mask_pool=mask_pool)
    return EngineParts(config=config, model_path=model_path, max_model_len=max_model_len,
                       model_config=model_config, tokenizer=tokenizer, runner=runner,
                       grammar=grammar, drafter=drafter, scheduler=scheduler)


def _grammar_backend(config: EngineConfig, tokenizer_hf: Any, *, vocab_size: int,
                     stop_token_ids: list[int]) -> GrammarBackend | SelectingBackend:
    """The grammar backend of ``config.grammar.backend``: xgrammar's
    :class:`GrammarBackend` as it is, or a :class:`SelectingBackend` over llguidance (and
    xgrammar, for ``auto``). ``llguidance`` starts no xgrammar compile processes; the mask
    workers serve the grammars of every backend the engine has."""
    mode = config.grammar.backend
    xgr_backend = None if mode == "llguidance" else GrammarBackend(
        tokenizer_hf, vocab_size=vocab_size, stop_token_ids=stop_token_ids,
        config=config.grammar)
    if mode == "xgrammar":
        assert xgr_backend is not None
        return xgr_backend
    llg = LlgBackend(tokenizer_hf, vocab_size=vocab_size, stop_token_ids=stop_token_ids,
                     config=config.grammar)
    return SelectingBackend(mode, xgrammar=xgr_backend, llguidance=llg)

def _fit_to_kv(runner: ModelRunner, config: EngineConfig, max_model_len: int) -> int:
    """``max_model_len``, lowered so that one request fits in the KV cache with its draft
    tree (:meth:`Scheduler.add`): a longer context could only be refused per request, so
    advertise what fits (like sglang).

    Raises:
        ValueError: the cache cannot hold even one token with a draft tree.
    """
    kv_tokens = (runner.kv_pool.num_pages - 1) * runner.page_size
    kv_limit = kv_tokens - config.spec.tree_size
    if kv_limit < 1:
        raise ValueError(f"kv_capacity_tokens is too small for one request with a "
                         f"{config.spec.tree_size}-node draft tree")
    if kv_limit < max_model_len:
        logger.warning("max_model_len %d lowered to %d: the KV cache (%d tokens) must hold "
                       "one whole request and its draft tree; raise kv_capacity_tokens "
                       "for more", max_model_len, kv_limit, kv_tokens)
        return kv_limit
    return max_model_len
