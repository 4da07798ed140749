"""A draft model with linear-attention layers (Qwen3-Next): its states resume where each step
starts (worker/spec/draft.py), so its drafts stay its own greedy tokens."""
from __future__ import annotations

import pytest
import torch

from octavo import LLM, SamplingParams
from tests.parity.test_tiny_models import _build


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["stack", "layers"])
def test_a_hybrid_draft_model_keeps_its_states_in_step(tmp_path, smollm_oracle_folder,
                                                       enforce_eager):
    """The target as its own draft model: greedy drafts then equal the target's tokens, so
    nearly all are accepted, which they are only if the draft's states resume after exactly the
    tokens each step starts from (prompt chunks of 40, drafts rejected nowhere but where the
    rounding differs, a second batch that resumes from prefix caching's saved states, the
    draft's included). Every request gives transformers' greedy tokens."""
    folder, ref = _build(tmp_path, smollm_oracle_folder, "qwen3-next")
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(100, 49000, (int(n),), generator=gen).tolist()
               for n in (23, 57, 90)]
    prompts += [p[:70] + [101, 102] for p in prompts[2:]]  # resumes at 64 in the second batch
    with torch.inference_mode():
        expected = [ref.generate(torch.tensor([p]), do_sample=False, max_new_tokens=20,
                                 pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
              max_num_batched_tokens=40, mamba_block_size=32, enforce_eager=enforce_eager,
              speculative_config={"method": "draft_model", "model": str(folder),
                                  "num_speculative_tokens": 3})
    try:
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        outs = llm.generate(prompts[:3], params, use_tqdm=False)
        outs += llm.generate(prompts[3:], params, use_tqdm=False)
        drafted, accepted, _ = llm.engine.client.core.scheduler.spec_counts
    finally:
        llm.engine.shutdown()
    for out, tokens in zip(outs, expected):
        assert list(out.outputs[0].token_ids) == tokens
    assert outs[3].num_cached_tokens == 64
    assert drafted > 40 and accepted >= 0.9 * drafted, (accepted, drafted)
