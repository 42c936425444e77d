"""Frozen configuration dataclasses.

Every knob of the engine lives in one of these. Derived values are properties, never fields,
so a config can not disagree with itself. "auto" choices are resolved once by
:func:`resolve_engine_config`, which returns a new config (``dataclasses.replace``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from structspec.core import seed_error
from structspec.speculative.registry import drafter_info, drafter_names

SpecAlgorithmName = str
"""A drafter name registered in :mod:`structspec.speculative.registry` (``none``, ``ngram``,
``draft_model``, ``eagle``, or one added with ``register_drafter``); checked by
:func:`resolve_engine_config`."""


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a decoder-only transformer (from HF ``config.json``).

    Raises:
        ValueError: from :meth:`from_hf_config` when the architecture is not supported or a
            required field is missing; the message names the field.
    """

    architecture: str  # HF class name, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k before rotary
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # frozen form of the HF dict
    hidden_act: str = "silu"

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling is not None else None

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF ``config.json``; see the class docstring for errors."""
        from structspec.models.architectures import SUPPORTED_ARCHITECTURES

        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' field; cannot pick a model class")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r} (config.json 'architectures'); "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )

        def need(key: str) -> Any:
            if key not in cfg or cfg[key] is None:
                raise ValueError(f"config.json is missing required field {key!r} for {arch}")
            return cfg[key]

        num_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        head_dim = cfg.get("head_dim") or hidden // num_heads
        rope_scaling = cfg.get("rope_scaling") or None
        rope_theta = cfg.get("rope_theta")
        if isinstance(cfg.get("rope_parameters"), dict):
            # transformers >= 5 moves rope_theta / rope_scaling into rope_parameters.
            params = dict(cfg["rope_parameters"])
            theta = params.pop("rope_theta", None)
            rope_theta = rope_theta if rope_theta is not None else theta
            if rope_scaling is None and params.get("rope_type", "default") != "default":
                rope_scaling = params
        if isinstance(rope_scaling, dict) and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        return cls(
            architecture=arch,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch == "Qwen3ForCausalLM",
            rope_scaling=tuple(sorted(rope_scaling.items())) if rope_scaling else None,
            hidden_act=str(cfg.get("hidden_act", "silu")),
        )


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing.

    The pool holds ``num_pages * page_size`` token slots per layer; slot 0 (page 0) is reserved
    as a write sink for padding rows, so it is never handed to a request.
    """

    page_size: int = 16
    num_pages: int | None = None  # None: sized from kv_capacity_tokens
    kv_capacity_tokens: int | None = None  # None: 32768 on CPU, 262144 on CUDA (resolved once)
    #: reuse the KV of cached full prompt pages across requests (kvcache/prefix_cache.py);
    #: ``--no-prefix-cache`` / ``LLM(enable_prefix_caching=False)`` turns it off
    enable_prefix_caching: bool = True

    @property
    def total_pages(self) -> int:
        if self.num_pages is not None:
            return self.num_pages
        if self.kv_capacity_tokens is None:
            raise ValueError("CacheConfig.kv_capacity_tokens is unresolved (call "
                             "resolve_engine_config first)")
        return -(-self.kv_capacity_tokens // self.page_size) + 1  # +1: the reserved sink page


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding: which drafter and how large a draft tree.

    ``num_draft_tokens`` counts node 0 (the last committed token), so a tree of N nodes
    proposes at most N-1 draft tokens. ``none`` is the degenerate tree of one node.

    ``adaptive`` (``--speculative-adaptive``) sizes each request's tree every step from its
    recent acceptance and the verify cost the engine measures on its device, down to no
    draft at all (:mod:`structspec.scheduler.tree_sizing`): ``on`` always, ``off`` never
    (every tree has ``num_draft_tokens`` nodes), ``auto`` where the measured cost of a full
    tree's rows reaches 1.25x a plain decode at the batch's size (a CPU; a GPU at large
    batch), unless below 2.5x full trees at the engine's average acceptance already beat plain
    decoding, decided while the engine runs, so it stays ``auto`` in a resolved config.
    """

    algorithm: str = "none"  # a registered drafter name (structspec.speculative.registry)
    num_draft_tokens: int = 8
    depth: int = 4  # draft_model / eagle: expansion steps
    topk: int = 2  # draft_model / eagle: children kept per expanded node
    draft_model: str | None = None  # path: draft_model checkpoint or EAGLE head
    ngram_min_window: int = 1
    ngram_max_window: int = 8
    ngram_branch_length: int = 12
    adaptive: str = "auto"  # auto | on | off (structspec.scheduler.tree_sizing)
    # eagle: auto = draft over the head's draft vocabulary when it ships one
    # (structspec.speculative.draft_vocab), full = always the whole vocabulary
    draft_vocab: str = "auto"

    @property
    def tree_size(self) -> int:
        return 1 if self.algorithm == "none" else self.num_draft_tokens


MAX_DRAFT_TOKENS = 128
"""Largest verify tree (``num_draft_tokens``) accepted. Every step verifies ``batch x N`` rows
and keeps an ``N x N`` ancestor mask per request; real trees are 4-64 nodes (sglang's EAGLE
defaults use 4-64), and a typo such as 100000 would otherwise try to allocate the draft KV
and CUDA-graph buffers for it (hundreds of GB) before failing."""

MAX_DRAFT_DEPTH = 64
"""Largest ``speculative_depth`` (draft_model / eagle expansion steps) accepted."""

MAX_DRAFT_TOPK = 64
"""Largest ``speculative_topk`` (children kept per expanded node) accepted."""


@dataclass(frozen=True)
class GrammarConfig:
    """Grammar compilation and enforcement (xgrammar, llguidance)."""

    # Which grammar engine compiles and enforces a request's grammar: "xgrammar" (the tuned
    # path: killable compile processes, mask worker processes, C++ tree walks), "llguidance"
    # (every grammar on llguidance: compiles on threads, tree masks built in the engine
    # process), or "auto" (per grammar: xgrammar when its strict check passes and it compiles
    # in time, else llguidance when it compiles the grammar exactly, else refused naming the
    # keyword's JSON pointer; structspec/grammar/select_backend.py).
    backend: str = "xgrammar"
    compile_timeout_s: float = 30.0
    num_compile_threads: int = 4
    cache_max_entries: int = 1024
    any_whitespace: bool = False  # False: compact JSON (`, ` and `: ` separators), fewer tokens
    max_rollback_tokens: int = 64  # must be >= the deepest draft path
    # Compiles run in killable worker processes (structspec/grammar/compile_pool.py): the
    # general lane has num_compile_threads of them, the lane for small grammars (canonical
    # text <= small_grammar_bytes) num_small_compile_workers; a small-lane compile still
    # running after small_lane_slice_s moves to the general lane, so small grammars never
    # wait behind expensive ones.
    num_small_compile_workers: int = 1
    small_grammar_bytes: int = 32 * 1024
    small_lane_slice_s: float = 2.0
    # Up-front limits (structspec/grammar/limits.py): a grammar over one is refused with code
    # grammar_too_complex before any compile. Each is far above every MaskBench schema
    # (largest: 153 kB, 131 properties, 2442 enum values, 721 JSON objects, {0,255}) and lets
    # a 100k-value enum and a 1 MB choice list through.
    max_grammar_bytes: int = 4 * 1024 * 1024  # canonical text of the schema/regex/grammar/choices
    max_schema_properties: int = 2048  # 'properties' of one object schema
    max_schema_enum_values: int = 100_000  # values of one 'enum'
    max_schema_subschemas: int = 20_000  # JSON objects (subschemas, keyword maps) in a schema
    max_regex_repeat: int = 65_536  # largest bound of one {n,m} (regex field or 'pattern')
    # Worker processes that walk the requests' draft trees for the tree bitmask
    # (structspec/grammar/worker_pool.py); 0 = walk in the scheduler's process. Threads cannot
    # do it: the GIL hand-offs around xgrammar's ~35 us walks cost as much as the walks.
    # None = auto (resolve_engine_config): default_grammar_workers(device).
    mask_build_workers: int | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_batch_size: int = 64
    max_prefill_tokens: int = 8192  # prompt tokens admitted into one prefill step
    overlap: bool = True  # overlap CPU work with the GPU step (ablation switch)
    # A prefill step runs only when it admits at least this many requests, or every waiting
    # one, or fills its token budget, or fewer than this many requests run. Under a backlog
    # (an offline run keeping several batches in flight) a request finishes nearly every
    # verify step at batch 256; admitting its replacement at once made every other step a
    # prefill of one or two prompts (the verify pipeline drained each time). Waiting for
    # this many free slots keeps the batch within ~1/8 of full and prefills them together.
    # None = max(1, max_batch_size // 8) (resolve_engine_config).
    min_prefill_batch: int | None = None
    #: prefill long prompts in chunks interleaved with the verify steps
    #: (scheduler/chunked_prefill.py); False (``--no-chunked-prefill``): whole prompts, one
    #: prefill step each, under ``max_prefill_tokens``
    enable_chunked_prefill: bool = True
    #: with chunking, the query rows one prefill step computes (requests x their longest
    #: chunk, padding included); None = auto, DEFAULT_MAX_NUM_BATCHED_TOKENS by device
    max_num_batched_tokens: int | None = None


DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cuda": 512, "cpu": 128}
"""``max_num_batched_tokens`` when left to auto, by device type: a prefill chunk then costs
about one verify step of the running batch, so the streams decoding beside a long prompt's
prefill keep their inter-token latency within ~2x (benchmarks/long_prompt_itl.py,
benchmarks/README.md "Chunked prefill")."""


@dataclass(frozen=True)
class EngineConfig:
    """Everything :class:`structspec.engine.llm_engine.LLMEngine` needs to start."""

    model: str | None = None  # local HF directory or .gguf file; None = the default model
    device: str = "auto"  # "auto" = cuda when available else cpu
    dtype: str = "auto"  # "auto" = bfloat16 on cuda, float32 on cpu
    # None = the model's max_position_embeddings; a larger value is refused
    # (check_max_model_len). The result is lowered, with a warning, to what the KV cache holds.
    max_model_len: int | None = None
    seed: int = 0
    cuda_graph: bool = True  # capture/replay verify forwards on CUDA (ignored on CPU)
    # "auto" = fused Triton kernels on CUDA when triton imports, else the torch reference;
    # "triton" = require them; "torch" = the reference ops everywhere (resolved once).
    kernels: str = "auto"
    # True = batch-invariant kernels for the target model (needs kernels "triton"): every
    # linear runs 16-row Triton tiles with an M-independent launch (gemv.invariant_linear)
    # and attention uses fixed blocks and fixed KV-chunk splits, so a token's logits do not
    # depend on how many rows shared its forward. cuBLAS and the default kernels choose
    # algorithms per row count, so a tree-verify forward (batch x tree rows) and a plain
    # decode (batch rows) round differently and spec-on / spec-off greedy outputs drift apart
    # in bf16. Off by default: slower (sglang --enable-deterministic-inference, vLLM
    # VLLM_BATCH_INVARIANT; Thinking Machines, "Defeating Nondeterminism in LLM Inference").
    batch_invariant: bool = False
    # Weight-only quantization of the target's linears on CPU (structspec/models/quantize.py):
    # "none" (the dtype's weights), "int8" (per-output-channel scales), "int4" (groups of 32
    # input channels: the GGUF's Q4_1 block, held exactly), or "auto": AUTO_CPU_QUANTIZATION
    # on CPU when dtype is "auto" (an explicit dtype keeps those weights), "none" on CUDA.
    # int8/int4 on CUDA are refused (the packed kernels are CPU kernels).
    quantization: str = "auto"
    # "auto" = read the checkpoint's weights; "dummy" = seeded random weights from config.json
    # only (vLLM's --load-format dummy: benchmarks of large shapes without their files).
    load_format: str = "auto"
    # Jinja text that replaces the tokenizer's chat template (vLLM's --chat-template); None =
    # the model's own. Entry points read a file into text (structspec.chat_template).
    chat_template: str | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    grammar: GrammarConfig = field(default_factory=GrammarConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            self.dtype
        ]


_DEVICE_RE = re.compile(r"cpu|cuda|cuda:\d+|auto")


def check_device(device: object) -> str:
    """``device`` if it is one of the accepted forms: ``cpu``, ``cuda``, ``cuda:N`` or
    ``auto``. The one place the device string is checked (``resolve_engine_config`` and the
    CLI, before any model loads, both call it).

    torch.device alone would accept ``mps``, ``meta`` or ``xpu``, which the engine's kernels,
    KV cache and CUDA graphs do not support, and fail later with a raw traceback; ``None``
    used to reach ``device.startswith`` as an AttributeError.

    Raises:
        ValueError: starting with ``device=`` (the CLI maps it to ``--device``), naming the
            accepted forms.
    """
    if not isinstance(device, str) or not _DEVICE_RE.fullmatch(device):
        raise ValueError(f"device={device!r}: expected cpu, cuda, cuda:N or auto")
    return device


def resolve_engine_config(config: EngineConfig) -> EngineConfig:
    """Resolve every "auto" choice once and return a new config.

    Raises:
        ValueError: naming the field whose value is invalid.
    """
    device = check_device(config.device)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available")
    dtype = config.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype={dtype!r}: expected float32, bfloat16, float16 or auto")
    _check_int_options(config)
    quantization = resolve_quantization(config.quantization, device=device,
                                        dtype_requested=config.dtype, dtype=dtype)
    spec = config.spec
    names = drafter_names()
    if spec.algorithm not in names:
        raise ValueError(f"speculative_algorithm={spec.algorithm!r}: expected "
                         f"{_one_of(names)}")
    drafter = drafter_info(spec.algorithm)
    if spec.adaptive not in ("auto", "on", "off"):
        raise ValueError(f"speculative_adaptive={spec.adaptive!r}: expected auto, on or off")
    if spec.draft_vocab not in ("auto", "full"):
        raise ValueError(f"speculative_draft_vocab={spec.draft_vocab!r}: expected auto or full")
    if spec.algorithm != "none" and not 2 <= spec.num_draft_tokens <= MAX_DRAFT_TOKENS:
        raise ValueError(f"num_draft_tokens={spec.num_draft_tokens}: expected 2.."
                         f"{MAX_DRAFT_TOKENS} when speculation is on")
    if drafter.eagle_head and not spec.draft_model:
        from structspec.models.shipped_heads import default_eagle_head

        head = default_eagle_head(config.model)
        if head is None:
            raise ValueError(f"speculative_algorithm={spec.algorithm!r} needs draft_model=PATH "
                             "(an EAGLE head directory): a trained head ships only for the "
                             "default model, SmolLM2-135M-Instruct")
        spec = dataclasses.replace(spec, draft_model=head)
    if drafter.needs_draft_model and not spec.draft_model:
        raise ValueError(f"speculative_algorithm={spec.algorithm!r} needs draft_model=PATH")
    if drafter.expands_tree:  # checked before the target model loads
        if not 1 <= spec.depth <= MAX_DRAFT_DEPTH:
            raise ValueError(f"speculative_depth={spec.depth}: expected 1..{MAX_DRAFT_DEPTH}")
        if not 1 <= spec.topk <= MAX_DRAFT_TOPK:
            raise ValueError(f"speculative_topk={spec.topk}: expected 1..{MAX_DRAFT_TOPK}")
    if (drafter.needs_draft_model and isinstance(spec.draft_model, str)
            and not Path(spec.draft_model).expanduser().exists()):
        # before the target loads, naming the argument (the loader's FileNotFoundError named
        # only a config.json path)
        raise ValueError(f"draft_model={spec.draft_model!r}: no such file or directory")
    kernels = config.kernels
    if kernels not in ("auto", "triton", "torch"):
        raise ValueError(f"kernels={kernels!r}: expected auto, triton or torch")
    if kernels == "auto":
        kernels = "triton" if device.startswith("cuda") and _triton_available() else "torch"
    elif kernels == "triton" and not (device.startswith("cuda") and _triton_available()):
        raise ValueError("kernels='triton' needs a CUDA device and the triton package")
    for name, flag in (("batch_invariant", config.batch_invariant),
                       ("cuda_graph", config.cuda_graph), ("overlap", config.scheduler.overlap)):
        if not isinstance(flag, bool):  # "false" is truthy: it would turn the option on
            raise ValueError(f"{name}={flag!r}: expected True or False")
    if config.batch_invariant and kernels != "triton":
        raise ValueError(f"batch_invariant=True needs the Triton kernels (a CUDA device and "
                         f"the triton package): kernels resolved to {kernels!r}")
    if config.chat_template is not None and not isinstance(config.chat_template, str):
        raise ValueError(f"chat_template={config.chat_template!r}: expected Jinja template "
                         "text or None")
    if config.load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format={config.load_format!r}: expected auto or dummy")
    timeout = config.grammar.compile_timeout_s
    if (isinstance(timeout, bool) or not isinstance(timeout, int | float)
            or not math.isfinite(timeout) or timeout <= 0):
        raise ValueError(f"grammar_compile_timeout_s={timeout!r}: expected a finite number of "
                         "seconds > 0")
    g = config.grammar
    if g.backend not in ("xgrammar", "llguidance", "auto"):
        raise ValueError(f"grammar_backend={g.backend!r}: expected xgrammar, llguidance or "
                         "auto")
    for name in ("num_compile_threads", "small_grammar_bytes", "max_grammar_bytes",
                 "max_schema_properties", "max_schema_enum_values", "max_schema_subschemas",
                 "max_regex_repeat"):
        value = getattr(g, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"GrammarConfig.{name}={value!r}: expected an integer >= 1")
    if (isinstance(g.num_small_compile_workers, bool)
            or not isinstance(g.num_small_compile_workers, int)
            or g.num_small_compile_workers < 0):
        raise ValueError(f"GrammarConfig.num_small_compile_workers="
                         f"{g.num_small_compile_workers!r}: expected an integer >= 0")
    if not (isinstance(g.small_lane_slice_s, int | float) and g.small_lane_slice_s > 0):
        raise ValueError(f"GrammarConfig.small_lane_slice_s={g.small_lane_slice_s!r}: expected "
                         "seconds > 0")
    if config.scheduler.max_batch_size < 1:
        raise ValueError("max_batch_size must be >= 1")
    scheduler = config.scheduler
    if scheduler.min_prefill_batch is None:
        scheduler = dataclasses.replace(
            scheduler, min_prefill_batch=max(1, scheduler.max_batch_size // 8))
    elif scheduler.min_prefill_batch < 1:
        raise ValueError(f"min_prefill_batch={scheduler.min_prefill_batch}: expected >= 1 "
                         "(or None for auto)")
    if not isinstance(scheduler.enable_chunked_prefill, bool):
        raise ValueError(f"enable_chunked_prefill={scheduler.enable_chunked_prefill!r}: "
                         "expected True or False")
    if scheduler.max_num_batched_tokens is None:
        scheduler = dataclasses.replace(scheduler, max_num_batched_tokens=(
            DEFAULT_MAX_NUM_BATCHED_TOKENS["cuda" if device.startswith("cuda") else "cpu"]))
    elif scheduler.max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens={scheduler.max_num_batched_tokens}: "
                         "expected an integer >= 1 (or None for auto): the query rows one "
                         "chunked prefill step computes")
    if config.max_model_len is not None and config.max_model_len < 1:
        raise ValueError(f"max_model_len={config.max_model_len}: expected >= 1 (or None for "
                         "the model's context length)")
    workers = config.grammar.mask_build_workers
    if workers is None:
        workers = default_grammar_workers(device)
    if not isinstance(workers, int) or isinstance(workers, bool):
        raise ValueError(f"grammar_workers={workers!r}: expected an integer >= 0 (or None for "
                         "auto)")
    if workers < 0:
        raise ValueError(f"grammar_workers={workers}: expected >= 0")
    cores = os.cpu_count() or 1
    if workers > 2 * cores:  # each is a Python process with torch imported
        raise ValueError(f"grammar_workers={workers}: more than twice this host's {cores} CPU "
                         "cores")
    grammar = dataclasses.replace(config.grammar, mask_build_workers=workers)
    if config.cache.page_size < 1:
        raise ValueError("page_size must be >= 1")
    cache = config.cache
    if cache.num_pages is None and cache.kv_capacity_tokens is None:
        cache = dataclasses.replace(
            cache, kv_capacity_tokens=262144 if device.startswith("cuda") else 32768
        )
    if cache.total_pages < 2:
        raise ValueError("kv_capacity_tokens must hold at least one page")
    return dataclasses.replace(config, device=device, dtype=dtype, cache=cache, kernels=kernels,
                               grammar=grammar, spec=spec, scheduler=scheduler,
                               quantization=quantization)


AUTO_CPU_QUANTIZATION = "int4"
"""What ``quantization="auto"`` becomes on CPU when ``dtype`` is left to auto. Measured on the
default model (SmolLM2-135M Q4_1 GGUF, 2-core AMD EPYC, batch 1 greedy, 96 new tokens; see
benchmarks/README.md, "CPU against llama.cpp (issue 22)"): int4 with groups of 32 is the
fastest decode and, holding the GGUF's Q4_1 blocks exactly, agrees with the float32 path's
argmax on 99.77% of teacher-forced positions over 50 prompts (int8: 98.96%, under the issue's
99% gate; benchmarks/quant_accuracy.py)."""

QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4")


def resolve_quantization(quantization: object, *, device: str, dtype_requested: str,
                         dtype: str) -> str:
    """The resolved ``EngineConfig.quantization``: ``none``, ``int8`` or ``int4``.

    ``auto`` is :data:`AUTO_CPU_QUANTIZATION` on CPU when ``dtype_requested`` is ``auto`` (an
    explicit ``dtype`` asks for weights of that dtype, so it stays unquantized), ``none``
    otherwise (CUDA's bf16 path has its own fused kernels).

    Raises:
        ValueError: starting with ``quantization=`` (the CLI maps it to ``--quantization``):
            an unknown value, int8/int4 on CUDA, or int8/int4 with a dtype other than
            float32 (the packed CPU kernels keep float32 activations).
    """
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization={quantization!r}: expected auto, none, int8 or int4")
    if quantization == "auto":
        if device == "cpu" and dtype_requested == "auto":
            return AUTO_CPU_QUANTIZATION
        return "none"
    if quantization != "none" and device != "cpu":
        raise ValueError(f"quantization={quantization!r} is for the CPU (torch's packed int8/"
                         f"int4 CPU kernels); on {device} use --quantization none (or auto), "
                         "which keeps the bfloat16 weights and the fused CUDA kernels")
    if quantization != "none" and dtype != "float32":
        raise ValueError(f"quantization={quantization!r} needs dtype float32 on CPU (the "
                         f"packed kernels keep float32 activations), got dtype={dtype!r}")
    return str(quantization)


def check_max_model_len(max_model_len: int | None, model_limit: int) -> int:
    """The context length an engine serves, before the KV cache's cap: ``max_model_len``, or
    the model's own ``model_limit`` (``max_position_embeddings``) when it is None.

    An explicit value above the model's is refused, as vLLM refuses it ("User-specified
    max_model_len (X) is greater than the derived max_model_len (max_position_embeddings=Y
    ...)"): the model was never trained on positions past its own (RoPE models emit garbage
    there), and quietly serving less than was asked for hides a typo such as 10**12.

    Raises:
        ValueError: ``max_model_len`` > ``model_limit``, naming both numbers.
    """
    if max_model_len is None:
        return model_limit
    if max_model_len > model_limit:
        raise ValueError(f"max_model_len={max_model_len} is greater than the model's context "
                         f"length ({model_limit} tokens, max_position_embeddings in its "
                         f"config.json); give at most {model_limit}, or leave it unset for the "
                         "model's")
    return max_model_len


def default_grammar_workers(device: str) -> int:
    """Grammar mask workers when ``grammar_workers`` is left to auto (None).

    On CUDA: ``min(8, cores // 2)`` (0 below 4 cores). There the verify forward of a small
    model takes ~1.5-3 ms, and at batch 32-64 the host's grammar work per step (matcher
    advance plus tree walks, ~1-2 ms in one process) outgrew it: JSON-Schema steps measured
    1.45x the no-grammar step in process vs 1.00-1.04x with 8 workers (SmolLM2-135M, H200,
    benchmarks/README.md). Half the cores leaves the rest to the scheduler, the front end
    and the tokenizer. On CPU: 0 - the forward itself takes the cores and dwarfs the
    grammar work.
    """
    if not device.startswith("cuda"):
        return 0
    cores = os.cpu_count() or 1
    return min(8, cores // 2) if cores >= 4 else 0


def _check_int_options(config: EngineConfig) -> None:
    """Refuse an integer option given as another type, naming the option and the expected
    type: ``num_draft_tokens="8"`` used to fail as ``TypeError: '<=' not supported between
    instances of 'int' and 'str'`` (or to pass unchecked with speculation off), and
    ``max_batch_size=2.5`` would size buffers with a float. ``seed`` must also lie in the
    one seed range (:data:`structspec.core.SEED_MAX`).

    Raises:
        ValueError: starting with the option's name (``flag_error`` maps it to its flag).
    """
    options: list[tuple[str, object, bool]] = [  # (name, value, None allowed)
        ("num_draft_tokens", config.spec.num_draft_tokens, False),
        ("speculative_depth", config.spec.depth, False),
        ("speculative_topk", config.spec.topk, False),
        ("max_batch_size", config.scheduler.max_batch_size, False),
        ("min_prefill_batch", config.scheduler.min_prefill_batch, True),
        ("max_num_batched_tokens", config.scheduler.max_num_batched_tokens, True),
        ("max_model_len", config.max_model_len, True),
        ("page_size", config.cache.page_size, False),
        ("kv_capacity_tokens", config.cache.kv_capacity_tokens, True),
        ("seed", config.seed, False),
    ]
    for name, value, optional in options:
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name}={value!r}: expected an integer"
                             f"{' (or None)' if optional else ''}, got "
                             f"{type(value).__name__}")
    # the engine seed takes the range of request seeds (one constant: core.SEED_MAX)
    why = seed_error(config.seed)
    if why is not None:
        raise ValueError(why)


def _one_of(names: tuple[str, ...]) -> str:
    """``"a, b, c or d"`` (``"a"`` for one name), as the config errors list choices."""
    if len(names) <= 1:
        return names[0] if names else "a registered drafter (none is registered)"
    return f"{', '.join(names[:-1])} or {names[-1]}"


def _triton_available() -> bool:
    """Whether ``import triton`` works (CPU builds of torch usually come without it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
