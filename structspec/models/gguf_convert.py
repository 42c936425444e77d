"""Convert a llama.cpp GGUF checkpoint (llama / qwen2 / qwen3) into a Hugging Face directory.

Weights are dequantized with ``gguf.quants.dequantize`` and written as float32 safetensors;
llama-arch Q/K weights are un-permuted from llama.cpp's rotary layout back to HF's. The result
is cached: the default directory is keyed by the file's content (sha256; remembered per path,
size and mtime so an unchanged file is hashed once), so copies of one GGUF in several
environments share one conversion. It is written to a temp dir, marked complete, and renamed
into place atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm.auto import tqdm

CONVERTER_VERSION = 1
MARKER = ".structspec-complete"
SHARD_BYTES = 4 << 30
_ARCHS = {  # GGUF general.architecture -> (HF architecture, HF model_type)
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def cache_root() -> Path:
    """``$STRUCTSPEC_CACHE_DIR`` if set, else ``~/.cache/structspec``."""
    env = os.environ.get("STRUCTSPEC_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "structspec"


def default_out_dir(gguf_path: str | os.PathLike[str]) -> Path:
    """``<cache_root>/gguf/<stem>-<16 hex of sha256(version, sha256 of the file)>``.

    The file's sha256 is remembered in ``<cache_root>/gguf-index/`` under its (size, mtime,
    absolute path), so an unchanged file is read once (~0.3 s per GB); a copy elsewhere (a
    new virtualenv's package data) is hashed once and then reuses the same conversion.

    Raises:
        FileNotFoundError: ``gguf_path`` does not exist.
    """
    p = Path(gguf_path).expanduser().resolve()
    st = p.stat()
    stat_key = f"{st.st_size}\0{st.st_mtime_ns}\0{p}".encode()
    index = cache_root() / "gguf-index" / hashlib.sha256(stat_key).hexdigest()[:32]
    try:
        digest = index.read_text().strip()
    except OSError:
        digest = ""
    if len(digest) != 64:
        sha = hashlib.sha256()
        with open(p, "rb") as f:
            while chunk := f.read(16 << 20):
                sha.update(chunk)
        digest = sha.hexdigest()
        index.parent.mkdir(parents=True, exist_ok=True)
        tmp = index.with_name(f"{index.name}.{os.getpid()}.tmp")
        tmp.write_text(digest)
        tmp.replace(index)  # atomic: a concurrent reader sees the old state or the digest
    key = f"{CONVERTER_VERSION}\0{digest}".encode()
    return cache_root() / "gguf" / f"{p.stem}-{hashlib.sha256(key).hexdigest()[:16]}"


def _meta(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        if gguf_name == "rope_freqs.weight":
            raise ValueError("GGUF has 'rope_freqs.weight' (Llama-3.1-style per-frequency rope "
                             "factors), which the converter does not support")
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent here")
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


def _arch(reader: GGUFReader, path: Path) -> str:
    arch = _meta(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; "
                         f"supported: {', '.join(sorted(_ARCHS))}")
    return str(arch)


def gguf_hf_config(reader: GGUFReader, path: Path) -> dict[str, Any]:
    """HF ``config.json`` content from GGUF metadata and tensor names.

    Raises:
        ValueError: unsupported architecture or a required metadata key is missing.
    """
    arch = _arch(reader, path)

    def need(key: str) -> Any:
        value = _meta(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{path}: GGUF metadata {arch}.{key} is missing")
        return value

    names = {t.name for t in reader.tensors}
    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    head_dim = _meta(reader, f"{arch}.attention.key_length")
    if head_dim is None and arch == "llama":
        head_dim = _meta(reader, f"{arch}.rope.dimension_count")
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ValueError(f"{path}: GGUF has no token_embd.weight tensor")
    eos, bos = _meta(reader, "tokenizer.ggml.eos_token_id"), _meta(reader, "tokenizer.ggml.bos_token_id")
    hf_arch, model_type = _ARCHS[arch]
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_meta(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(head_dim or hidden // heads),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_meta(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(need("context_length")),
        "vocab_size": int(embd.shape[-1]),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
    }
    scaling = _meta(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        rope: dict[str, Any] = {"rope_type": scaling, "factor": float(need("rope.scaling.factor"))}
        orig = _meta(reader, f"{arch}.rope.scaling.original_context_length")
        if orig is not None:
            rope["original_max_position_embeddings"] = int(orig)
        cfg["rope_scaling"] = rope
    return cfg


def _eos_ids(reader: GGUFReader) -> list[int]:
    """GGUF end-of-generation ids: eos, then eot / eom when present and different."""
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = _meta(reader, f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return ids


def _reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of q/k rows (weights ``[rows, in]`` or bias ``[rows]``)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensor(t: ReaderTensor, arch: str, cfg: dict[str, Any]) -> torch.Tensor:
    w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
    w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
    if arch == "llama" and (".attn_q." in t.name or ".attn_k." in t.name):
        heads = cfg["num_attention_heads"] if ".attn_q." in t.name else cfg["num_key_value_heads"]
        w = _reverse_permute(w, heads)
    w = np.ascontiguousarray(w)
    return torch.from_numpy(w if w.flags.writeable else w.copy())


def _write_weights(
    reader: GGUFReader, arch: str, cfg: dict[str, Any], out: Path, label: str
) -> None:
    plan: list[list[tuple[ReaderTensor, str]]] = [[]]
    size = 0
    for t in reader.tensors:
        nbytes = 4 * int(np.prod([int(d) for d in t.shape]))
        if plan[-1] and size + nbytes > SHARD_BYTES:
            plan.append([])
            size = 0
        plan[-1].append((t, _hf_name(t.name)))
        size += nbytes
    n = len(plan)
    files = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map: dict[str, str] = {}
    with tqdm(total=len(reader.tensors), desc=f"Converting {label}", unit="tensor") as bar:
        for shard, fname in zip(plan, files, strict=True):
            tensors: dict[str, torch.Tensor] = {}
            for t, name in shard:
                tensors[name] = _tensor(t, arch, cfg)
                weight_map[name] = fname
                bar.update(1)
            save_file(tensors, str(out / fname), metadata={"format": "pt"})
    if n > 1:
        index = {"metadata": {}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_tokenizer(gguf_path: Path, reader: GGUFReader, out: Path, eos_ids: list[int]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    fixed: dict[str, Any] = {}
    for attr, ids in (("eos_token", eos_ids[:1]), ("bos_token", [_meta(reader, "tokenizer.ggml.bos_token_id")])):
        if ids and ids[0] is not None:
            fixed[attr] = tok.convert_ids_to_tokens(int(ids[0]))
            setattr(tok, attr, fixed[attr])
    template = _meta(reader, "tokenizer.chat_template")
    if template:
        tok.chat_template = template
    tok.save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    tok_cfg.update(fixed)
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"  # loadable by transformers 4 and 5
    if template:
        tok_cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False))


def _convert_into(gguf_path: Path, out: Path) -> None:
    reader = GGUFReader(str(gguf_path))
    arch = _arch(reader, gguf_path)
    cfg = gguf_hf_config(reader, gguf_path)
    eos_ids = _eos_ids(reader)
    if eos_ids:
        cfg["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    _write_weights(reader, arch, cfg, out, gguf_path.name)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    gen: dict[str, Any] = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
    pad = _meta(reader, "tokenizer.ggml.padding_token_id")
    if pad is not None:
        gen["pad_token_id"] = int(pad)
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    if _meta(reader, "tokenizer.ggml.model") is not None:  # weights-only GGUFs have none
        _write_tokenizer(gguf_path, reader, out, eos_ids)


def convert_gguf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str] | None = None) -> Path:
    """Convert ``gguf_path`` to a HF model directory and return it (reused when complete).

    Writes ``config.json``, float32 ``model.safetensors`` (sharded above 4 GiB),
    ``generation_config.json`` (eos/bos from the GGUF metadata), and tokenizer files with the
    GGUF's chat template and eos token (skipped when the GGUF has no tokenizer). Shows a tqdm
    bar over tensors.

    Args:
        gguf_path: a llama / qwen2 / qwen3 GGUF file (any quantization gguf-py dequantizes).
        out_dir: target directory; default :func:`default_out_dir`.

    Raises:
        FileNotFoundError: ``gguf_path`` does not exist.
        FileExistsError: ``out_dir`` exists, is not empty and is not a completed conversion.
        ValueError: unsupported architecture, tensor or metadata (message says which).
    """
    src = Path(gguf_path).expanduser()
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file {str(src)!r} does not exist")
    out = Path(out_dir).expanduser() if out_dir is not None else default_out_dir(src)
    if (out / MARKER).is_file():
        return out
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists but is not a completed GGUF conversion; remove it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
    try:
        _convert_into(src.resolve(), tmp)
        (tmp / MARKER).write_text(json.dumps({"source": str(src.resolve()), "version": CONVERTER_VERSION}))
        try:
            os.rename(tmp, out)  # atomic; replaces an empty directory
        except OSError:
            if not (out / MARKER).is_file():  # else: lost a race to a concurrent converter
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
