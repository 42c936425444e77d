"""Build the Llama-3-shaped benchmark assets from the ``llama-cpp-python`` source distribution.

The sdist vendors llama.cpp's vocab-only GGUF of the Llama-3 tokenizer
(``vendor/llama.cpp/models/ggml-vocab-llama-bpe.gguf``, no weights) together with reference
tokenizations (``.gguf.inp`` / ``.gguf.out``). This script turns that GGUF into a Hugging Face
fast tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) equivalent to Meta's Llama-3
one, checks it against the reference tokenizations, and writes two model directories made of
``config.json`` + ``generation_config.json`` + the tokenizer and no weights, meant for
``load_format="dummy"`` (seeded random weights built directly on the device):

* ``<out>/llama3-8b-shape/``: the Llama-3-8B(-Instruct) shape (32 layers, hidden 4096, GQA
  32/8, intermediate 14336, vocab 128256, untied);
* ``<out>/llama3-1b-draft-shape/``: the Llama-3.2-1B shape (16 layers, hidden 2048, GQA 32/8,
  intermediate 8192, tied), a draft model for ``speculative_algorithm="draft_model"``.

The reference tokenization files are copied to ``tests/data/llama3-vocab/`` for the tests.

Why not transformers' GGUF tokenizer conversion: its Llama-3 output (transformers 5.24) has
the right pre-tokenizer but leaves ``ignore_merges`` off (so e.g. " Việt" tokenizes to 3
tokens instead of Meta's 1 and a reference case fails), adds no BOS post-processor and
appends a spurious 128257th token ``<|endoftext|>``. Building the tokenizer from the GGUF's
tokens and merges with the ``tokenizers`` library, with Meta's Llama-3 settings, reproduces
all reference tokenizations.

Usage (PyPI access needed only for the download)::

    pip download llama-cpp-python==0.3.36 --no-binary :all: --no-deps -d /tmp/lcp
    python benchmarks/make_llama3_assets.py /tmp/lcp/llama_cpp_python-0.3.36.tar.gz

``SOURCE`` may also be an extracted sdist directory or the ``.gguf`` file itself (its
``.inp``/``.out`` siblings are then used when present).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import Any

GGUF_MEMBER = "vendor/llama.cpp/models/ggml-vocab-llama-bpe.gguf"
REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "assets"
TEST_DATA = REPO / "tests" / "data" / "llama3-vocab"

#: llama.cpp's ``LLAMA_VOCAB_PRE_TYPE_LLAMA3`` split regex (= Meta's tiktoken pattern, as in
#: the ``Split`` pre-tokenizer of Meta-Llama-3's tokenizer.json).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BOS, EOT = "<|begin_of_text|>", "<|eot_id|>"
#: Meta-Llama-3-8B-Instruct's chat template.
CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
COMMON = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128009],
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}
#: Llama-3-8B(-Instruct) shape: 8.03 B parameters, 16.06 GB in bf16.
CONFIG_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], **COMMON,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "max_position_embeddings": 8192, "rope_scaling": None, "tie_word_embeddings": False,
}
#: Llama-3.2-1B shape: 1.24 B parameters (tied embeddings), 2.47 GB in bf16.
CONFIG_1B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], **COMMON,
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "head_dim": 64,
    "max_position_embeddings": 131072, "tie_word_embeddings": True,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}
GENERATION_CONFIG = {"bos_token_id": 128000, "eos_token_id": [128001, 128009],
                     "do_sample": True, "temperature": 0.6, "top_p": 0.9}
TOKENIZER_CONFIG = {
    "add_bos_token": True,
    "add_eos_token": False,
    "bos_token": BOS,
    "eos_token": EOT,
    "clean_up_tokenization_spaces": False,
    "model_input_names": ["input_ids", "attention_mask"],
    "model_max_length": 8192,
    "tokenizer_class": "PreTrainedTokenizerFast",  # loadable by transformers 4 and 5
    "chat_template": CHAT_TEMPLATE,
}
_SDIST_RE = re.compile(r"llama_cpp_python-([0-9][^/]*?)(?:\.tar\.gz)?$")


def extract_vocab(source: Path, work: Path) -> tuple[Path, str]:
    """The Llama-3 vocab GGUF (+ ``.inp``/``.out``) from ``source``, and the sdist's name.

    Args:
        source: the sdist ``.tar.gz``, an extracted sdist directory, or the ``.gguf`` file.
        work: scratch directory for extraction.

    Returns:
        ``(path of the .gguf, human-readable source label)``.

    Raises:
        FileNotFoundError: ``source`` does not exist or does not contain the GGUF.
    """
    if not source.exists():
        raise FileNotFoundError(f"{source}: no such file or directory")
    if source.is_file() and source.suffix == ".gguf":
        return source, source.name
    m = _SDIST_RE.search(source.name)
    label = f"llama-cpp-python {m.group(1)} sdist" if m else source.name
    if source.is_dir():
        gguf = source / GGUF_MEMBER
        if not gguf.is_file():
            raise FileNotFoundError(f"{source}: no {GGUF_MEMBER}")
        return gguf, label
    with tarfile.open(source) as tar:
        members = [mb for mb in tar.getmembers()
                   if mb.name.split("/", 1)[-1] in (GGUF_MEMBER, GGUF_MEMBER + ".inp",
                                                     GGUF_MEMBER + ".out")]
        if not any(mb.name.endswith(".gguf") for mb in members):
            raise FileNotFoundError(f"{source}: the archive has no {GGUF_MEMBER}")
        for mb in members:
            f = tar.extractfile(mb)
            assert f is not None
            (work / Path(mb.name).name).write_bytes(f.read())
    return work / Path(GGUF_MEMBER).name, label


def build_tokenizer(gguf_path: Path) -> Any:
    """A ``tokenizers.Tokenizer`` equal to Meta's Llama-3 one, from a llama-bpe vocab GGUF.

    Byte-level BPE over the GGUF's 128,256 tokens and 280,147 merges, ``ignore_merges`` on
    (a pre-token that is itself in the vocabulary is one token), the Llama-3 split regex, the
    256 control tokens as special added tokens, BOS prepended by the post-processor.

    Raises:
        ValueError: the GGUF is not a ``gpt2``/``llama-bpe`` vocabulary.
    """
    from gguf import GGUFReader
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    reader = GGUFReader(str(gguf_path))

    def meta(key: str) -> Any:
        field = reader.get_field(key)
        return None if field is None else field.contents()

    if meta("tokenizer.ggml.model") != "gpt2" or meta("tokenizer.ggml.pre") != "llama-bpe":
        raise ValueError(f"{gguf_path}: expected tokenizer.ggml.model 'gpt2' and pre "
                         f"'llama-bpe', got {meta('tokenizer.ggml.model')!r} / "
                         f"{meta('tokenizer.ggml.pre')!r}")
    tokens: list[str] = list(meta("tokenizer.ggml.tokens"))
    types: list[int] = [int(t) for t in meta("tokenizer.ggml.token_type")]
    merges = [tuple(m.split(" ")) for m in meta("tokenizer.ggml.merges")]
    if any(len(m) != 2 for m in merges):
        raise ValueError(f"{gguf_path}: a merge is not two space-separated tokens")
    bos_id = int(meta("tokenizer.ggml.bos_token_id"))
    if tokens[bos_id] != BOS:
        raise ValueError(f"{gguf_path}: bos token {bos_id} is {tokens[bos_id]!r}, not {BOS!r}")
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True, fuse_unk=False,
                               byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1",
                                      special_tokens=[(BOS, bos_id)]),
    ])
    control = [t for t, ty in zip(tokens, types, strict=True) if ty == 3]  # GGUF CONTROL
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise ValueError("special tokens were added as new ids (they must be in the vocab)")
    return tok


def read_reference(gguf_path: Path) -> list[tuple[str, list[int]]]:
    """``(text, token ids without BOS)`` pairs of llama.cpp's ``.inp``/``.out`` files.

    Raises:
        FileNotFoundError: the files are not next to ``gguf_path``.
        ValueError: the two files disagree in length.
    """
    return parse_reference(Path(f"{gguf_path}.inp").read_text(encoding="utf-8"),
                           Path(f"{gguf_path}.out").read_text(encoding="utf-8"))


def parse_reference(inp: str, out: str) -> list[tuple[str, list[int]]]:
    """Parse llama.cpp ``test-tokenizer-0`` files (see :func:`read_reference`)."""
    texts = inp.split("\n__ggml_vocab_test__\n")
    ids = out.split("\n")
    if texts and texts[-1] == "":
        texts.pop()
    if ids and ids[-1] == "":
        ids.pop()
    if len(texts) != len(ids):
        raise ValueError(f"{len(texts)} reference texts but {len(ids)} tokenizations")
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, ids, strict=True)]


def write_model_dir(out: Path, config: dict[str, Any], tokenizer: Any | None,
                    readme: str) -> None:
    """``config.json``, ``generation_config.json``, compact ``tokenizer.json`` and
    ``tokenizer_config.json`` (unless ``tokenizer`` is None), a README; replaces ``out``."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(str(out / "tokenizer.json"), pretty=False)
        (out / "tokenizer_config.json").write_text(
            json.dumps(TOKENIZER_CONFIG, indent=2, ensure_ascii=False) + "\n")
    (out / "README.md").write_text(readme)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path,
                    help="llama-cpp-python sdist (.tar.gz), its extracted directory, or the "
                         "ggml-vocab-llama-bpe.gguf file")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="assets directory")
    ap.add_argument("--test-data", type=Path, default=TEST_DATA,
                    help="where the reference tokenizations are copied for the tests")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        gguf, label = extract_vocab(args.source.expanduser(), Path(tmp))
        tok = build_tokenizer(gguf)
        ref = read_reference(gguf)
        bad = [(t, want, tok.encode(t, add_special_tokens=False).ids) for t, want in ref
               if tok.encode(t, add_special_tokens=False).ids != want]
        if bad:
            for t, want, got in bad[:5]:
                print(f"MISMATCH {t[:40]!r}: want {want[:12]} got {got[:12]}")
            raise SystemExit(f"{len(bad)}/{len(ref)} reference tokenizations differ")
        print(f"tokenizer reproduces {len(ref)}/{len(ref)} reference tokenizations of {label}")
        args.test_data.mkdir(parents=True, exist_ok=True)
        for ext in (".inp", ".out"):
            shutil.copyfile(f"{gguf}{ext}", args.test_data / f"{gguf.name}{ext}")
    note = ("Generated by `benchmarks/make_llama3_assets.py` from the Llama-3 vocabulary in\n"
            f"{label} (`{GGUF_MEMBER}`).\n"
            "No weights: load with `load_format=\"dummy\"` (CLI `--load-format dummy`).\n"
            "Source and license: see `../README.md`.\n")
    write_model_dir(args.out / "llama3-8b-shape", CONFIG_8B, tok,
                    f"# Llama-3-8B(-Instruct) shape: config + tokenizer, no weights\n\n{note}")
    # A draft model needs no tokenizer of its own (the target's is used; the vocabulary sizes
    # are checked): one copy keeps the repo small enough to travel to the GPU host.
    write_model_dir(args.out / "llama3-1b-draft-shape", CONFIG_1B, None,
                    "# Llama-3.2-1B shape: config only, no weights, no tokenizer\n\n"
                    "A draft model for `llama3-8b-shape` (it uses the target's tokenizer).\n"
                    + note)
    for d in ("llama3-8b-shape", "llama3-1b-draft-shape"):
        size = sum(f.stat().st_size for f in (args.out / d).iterdir())
        print(f"wrote {args.out / d} ({size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
