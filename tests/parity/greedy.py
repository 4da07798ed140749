"""The real-weight parity criterion, shared by every catalog model's test.

Greedy tokens of octavo against transformers on the same weights: identical tokens, or at the
first divergence each side's token is in the other's top-5 logprobs (then comparing stops).
transformers' side is computed once per (model, transformers version, prompts) and cached next to
the oracle folder, so reruns cost only octavo's own time.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from octavo import SamplingParams

NEW_TOKENS = 32
TOP = 5
PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=TOP)

_STORY = ("The old lighthouse keeper climbed the spiral stairs every evening, counting each of the "
          "one hundred and twelve steps, listening to the sea breathe against the rocks below. ")


def prompts(tokenizer) -> list[list[int]]:
    """Eight prompts from 5 to about 560 tokens: code, prose, lists, and three long stories."""
    texts = [
        "The capital of France is",
        "def fib(n):",
        "Explain in a few sentences why the sky is blue.",
        "List three colors: red,",
        "import numpy as np\nimport torch\n\nclass Model(torch.nn.Module):\n    def __init__(self",
        _STORY * 4 + "What did the keeper count?",
        _STORY * 9 + "Summarize the story above in one sentence:",
        _STORY * 18 + "The keeper's name was",
    ]
    ids = [tokenizer(t).input_ids for t in texts]
    lengths = [len(i) for i in ids]
    assert min(lengths) >= 2 and 500 <= max(lengths) <= 600, lengths
    return ids


def oracle_results(folder: Path) -> tuple[list[list[int]], list[tuple]]:
    """Prompts and, per prompt, transformers' (greedy tokens, top-5 ids per step, logprob of each
    prompt token 1.. given its prefix)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    ids = prompts(tok)
    key = hashlib.sha256(json.dumps([transformers.__version__, NEW_TOKENS, TOP, ids]).encode())
    saved = folder / f"greedy-{key.hexdigest()[:16]}.pt"
    if saved.is_file():
        return ids, torch.load(saved)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    results = []
    with torch.inference_mode():
        for p in ids:
            out = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                 output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=tok.pad_token_id or tok.eos_token_id)
            tokens = out.sequences[0, len(p):].tolist()
            top = [torch.log_softmax(x[0].float(), -1).topk(TOP).indices.tolist()
                   for x in out.logits]
            lp = torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1)
            prompt_lp = lp[torch.arange(len(p) - 1), torch.tensor(p[1:])].clone()
            results.append((tokens, top, prompt_lp))
    tmp = saved.with_suffix(".partial")
    torch.save(results, tmp)
    tmp.rename(saved)
    return ids, results


def check(octavo_outs, results) -> int:
    """Assert the criterion for every prompt; returns how many matched exactly."""
    exact = 0
    for i, (out, (ref_tokens, ref_top, _)) in enumerate(zip(octavo_outs, results)):
        ours = out.outputs[0].token_ids
        ours_top = [list(pos) for pos in out.outputs[0].logprobs]
        n = min(len(ours), len(ref_tokens))
        for j in range(n):
            if ours[j] != ref_tokens[j]:
                assert ours[j] in ref_top[j] and ref_tokens[j] in ours_top[j], (
                    f"prompt {i} diverges at token {j}: octavo {ours[j]} (top {ours_top[j]}), "
                    f"transformers {ref_tokens[j]} (top {ref_top[j]})")
                break
        else:
            assert len(ours) == len(ref_tokens), f"prompt {i}: lengths {len(ours)} != {len(ref_tokens)}"
            exact += 1
    return exact


def check_single_and_batched(llm, ids, results, min_exact: int = 6) -> None:
    single = [llm.generate([p], PARAMS, use_tqdm=False)[0] for p in ids]
    assert check(single, results) >= min_exact
    batched = llm.generate(ids, PARAMS, use_tqdm=False)
    assert check(batched, results) >= min_exact
    # Batch composition must not change greedy output beyond the top-5 tolerance either.
    assert sum(a.outputs[0].token_ids == b.outputs[0].token_ids
               for a, b in zip(single, batched)) >= min_exact


def check_prompt_logprobs(llm, ids, results, atol: float = 1e-2) -> None:
    for p, (_, _, ref) in list(zip(ids, results))[5:7]:
        out = llm.generate([p], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
        assert out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(p)
        ours = torch.tensor([out.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))])
        assert torch.allclose(ours, ref, atol=atol), (ours - ref).abs().max()
