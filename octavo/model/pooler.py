"""Pooling: each request's hidden states into one vector, as sentence-transformers' Pooling module
computes it (the mean of its tokens, its first token, [CLS], or its last) and its Normalize module
(unit length), with a request's `dimensions` kept first (Matryoshka models); or into what its
task asks (`pool_requests`): one vector per token, a classifier's probabilities, a decoder
head's rewards per token or step tag. A pooling request's prompt is whole in the step that
pools it (the scheduler sees to that), so its rows are [start, end) of the step's flat hidden
states."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from octavo.pooling_params import PoolingParams

POOLING_KINDS = ("mean", "cls", "last")


def pool(hidden: torch.Tensor, starts: np.ndarray, ends: np.ndarray, kind: str) -> torch.Tensor:
    """hidden [T, H]; the sequences' rows [starts[i], ends[i]) -> [len(starts), H] float32."""
    if kind == "cls":
        return hidden.index_select(0, torch.from_numpy(starts).to(hidden.device)).float()
    if kind == "last":
        return hidden.index_select(0, torch.from_numpy(ends - 1).to(hidden.device)).float()
    if kind != "mean":
        raise ValueError(f"pooling must be one of {', '.join(POOLING_KINDS)}, got {kind!r}")
    lengths = ends - starts
    which = np.repeat(np.arange(len(starts)), lengths)  # each pooled row's sequence
    offsets = np.cumsum(lengths) - lengths  # where each sequence's rows start among them
    rows = starts[which] + np.arange(len(which)) - offsets[which]
    device = hidden.device
    sums = torch.zeros((len(starts), hidden.shape[1]), dtype=torch.float32, device=device)
    sums.index_add_(0, torch.from_numpy(which).to(device),
                    hidden.index_select(0, torch.from_numpy(rows).to(device)).float())
    return sums / torch.from_numpy(lengths).to(device, torch.float32).unsqueeze(1)


def finish(vectors: torch.Tensor, dimensions: list[int | None],
           normalize: list[bool]) -> list[np.ndarray]:
    """Each pooled row cut to its request's dimensions (None: all) and, where asked, scaled to
    unit length (rows of several vectors: each of them)."""
    out = []
    for row, dims, unit in zip(vectors, dimensions, normalize):
        if dims is not None:
            row = row[..., :dims]
        if unit:
            row = F.normalize(row, dim=-1)
        out.append(row.cpu().numpy())
    return out


def head_probs(logits: torch.Tensor) -> torch.Tensor:
    """A classifier's probabilities: a softmax over its labels, a sigmoid for one label."""
    return logits.sigmoid() if logits.shape[1] == 1 else logits.softmax(-1)


def pool_requests(model, hidden: torch.Tensor, params: list[PoolingParams],
                  starts: np.ndarray, ends: np.ndarray,
                  token_ids: np.ndarray) -> list[np.ndarray]:
    """Each pooling request's output, by its task (its params resolved: every default filled
    in): embed, one vector pooled as the model's config says; token_embed, one per token;
    classify and score, a classifier's probabilities over its pooled [CLS] (or last, or mean)
    state; reward, per token (or per step tag) a decoder's score head's probabilities, or its
    LM head's softmax over returned_token_ids. `token_ids`: the step's flat input ids."""
    out: list[np.ndarray | None] = [None] * len(params)
    tasks = np.array([p.task for p in params])
    embed = np.flatnonzero(tasks == "embed")
    if len(embed):
        vectors = finish(pool(hidden, starts[embed], ends[embed], model.cfg.pooling_kind),
                         [params[i].dimensions for i in embed],
                         [params[i].normalize for i in embed])
        for i, vector in zip(embed, vectors):
            out[i] = vector
    heads = np.flatnonzero((tasks == "classify") | (tasks == "score"))
    if len(heads):
        logits = model.classify(pool(hidden, starts[heads], ends[heads],
                                     model.classifier_token))
        for i, probs in zip(heads, head_probs(logits).cpu().numpy()):
            out[i] = probs
    for i in np.flatnonzero((tasks == "token_embed") | (tasks == "reward")):
        p = params[i]
        rows = hidden[starts[i]:ends[i]]
        if p.task == "token_embed":
            out[i] = finish(rows[None].float(), [p.dimensions], [p.normalize])[0]
            continue
        if p.step_tag_id is not None:  # step pooling: the step tags' positions only
            at = np.flatnonzero(token_ids[starts[i]:ends[i]] == p.step_tag_id)
            rows = rows.index_select(0, torch.from_numpy(at).to(rows.device))
        if hasattr(model, "classify"):
            values = head_probs(model.classify(rows))
        else:
            logits = model.compute_logits(rows).float()
            values = logits[:, torch.tensor(p.returned_token_ids, device=rows.device)]
            values = values.softmax(-1)
        out[i] = values.cpu().numpy()
    return out
