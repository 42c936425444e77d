"""GPU: the model forward has no host syncs and replays from a CUDA graph (SmolLM2 shape)."""

from __future__ import annotations

import pytest
import torch

from structspec.config import ModelConfig
from structspec.kvcache.pool import KVPool
from structspec.layers.forward_batch import ForwardBatch
from structspec.models.llama import LlamaForCausalLM
from tests.graph_check import assert_no_sync_and_graph_replay

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _batch(b: int, q: int, n: int, dev: torch.device) -> ForwardBatch:
    g = torch.Generator(device="cpu").manual_seed(b * 1000 + q)
    out = (16 + torch.arange(b * q)).view(b, q)
    kv = torch.randint(16, 2048, (b, n), generator=g)
    kv[:, -q:] = out
    mask = torch.rand(b, q, n, generator=g) > 0.5
    mask[..., 0] = True
    pos = torch.arange(n - q, n).expand(b, q).contiguous()
    ids = torch.randint(0, 1000, (b, q), generator=g)
    return ForwardBatch(*(t.to(dev) for t in (ids, pos, out, kv, mask)))


@pytest.mark.parametrize("shape", [(1, 1, 512), (1, 8, 520), (8, 8, 520)])
@torch.no_grad()
def test_no_sync_and_graph_replay(shape: tuple[int, int, int]) -> None:
    dev = torch.device("cuda")
    cfg = ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e5,
        max_position_embeddings=8192, tie_word_embeddings=True, qk_norm=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(dev, torch.bfloat16)
    model.rotary.reset_inv_freq()
    pool = KVPool(num_layers=30, num_pages=128, page_size=16, num_kv_heads=3, head_dim=64,
                  dtype=torch.bfloat16, device=dev)
    fb = _batch(*shape, dev)

    def step() -> torch.Tensor:
        out = model(fb, pool, aux_hidden_layers=(2, 15))
        return model.compute_logits(out.hidden_states.view(-1, cfg.hidden_size))

    ref = step()
    graph = assert_no_sync_and_graph_replay(step, ref)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    print(f"B,Q,L={shape}: graph replay {start.elapsed_time(end) / 50:.3f} ms / forward")
