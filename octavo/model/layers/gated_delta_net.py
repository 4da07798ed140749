"""Gated DeltaNet: linear attention over a recurrent state per request (Qwen3-Next's linear
layers), computed whole as a layer's mixer.

Each token's q, k, v come from one projection (grouped per key head: q, k, then its value heads'
v and output gates z) through a causal depthwise convolution (kernel K, silu); with q and k
L2-normalized and q scaled by 1/sqrt(d_k), each value head h keeps a state S [d_k, d_v]:

    S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q

where beta = sigmoid(b) and g = -exp(A_log) softplus(a + dt_bias) come from a second projection.
The output is RMS-normalized per head, times silu(z), and projected back.

The state of a request is its conv window (the last K - 1 inputs) and S per value head, kept in
the layer's state buffers at the request's batch row (InputBatch), for as long as the request
is in the batch: it starts empty at the request's first token (its row reused by a new request or
by a preempted one started over), and is carried from one prompt chunk to the next. Prompt
chunks run the chunked form of the recurrence (a triangular solve per chunk of 64 tokens: the
same S and outputs as token by token); single-token steps are one batched update.

Speculative decoding: a span that ends in draft tokens is computed from the state before it,
which stays as it was; the span's inputs are kept in the span buffers at the request's row (its
conv sequence, convolved inputs, beta and g; both executions write them) until the engine says
how many of its tokens were accepted (`accept_span`, from worker/spec/verified_spans.py), and
the state then moves over those alone (a short chunk).

Context parallelism with split tokens: a state runs through the step's tokens in order, so every
rank of the group computes the layer over all of them (their inputs gathered) and keeps its own
rows' outputs; each rank holds the whole states, alike.

Prefix caching (core/state_checkpoints.py): the state buffers hold checkpoint slots after the
batch rows. A step may save a request's state after some of its tokens into a slot (a prompt
chunk is then computed in pieces that end there), and a request that resumes from a cached
prefix starts from a slot's copy (`restore_states`)."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from octavo.arch_config import ArchConfig
from octavo.kernels import fused
from octavo.model import context_parallel
from octavo.model.context import ForwardContext, get_forward_context
from octavo.model.layers.linear import Linear, Span, column_parallel, even_span, row_parallel
from octavo.model.layers.opaque import call_opaque

CHUNK = 64  # tokens a triangular solve takes at once in a prompt chunk


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output (weight over d_v), times silu(z) in float32."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    """Under tensor parallelism a rank holds whole key heads with their value heads: its rows
    of the projections (grouped per key head), its q, k and v conv channels, decay parameters
    and states, and its columns of out_proj, whose partial outputs the ranks sum."""

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        k_heads = cfg.required("linear_num_key_heads")
        v_heads = cfg.required("linear_num_value_heads")
        self.dk = cfg.required("linear_key_head_dim")
        self.dv = cfg.required("linear_value_head_dim")
        if v_heads % k_heads:
            raise ValueError(f"linear_num_value_heads ({v_heads}) is not a multiple of "
                             f"linear_num_key_heads ({k_heads})")
        heads = even_span(k_heads, "linear_num_key_heads")  # this rank's key heads
        per = v_heads // k_heads
        self.k_heads, self.v_heads = heads.width, heads.width * per
        self.kernel = cfg.extra.get("linear_conv_kernel_dim") or 4
        key, value = self.k_heads * self.dk, self.v_heads * self.dv
        self.conv_dim = 2 * key + value
        # Hugging Face's checkpoints group the projection's rows per key head (its q, k, then
        # its value heads' v and z); llama.cpp's converter writes q | k | v of all heads and z
        # apart, which load as the four slots q, k, v, z of the same Linear (each cut to this
        # rank's heads).
        self.qkvz_split = bool(cfg.extra.get("linear_qkvz_split"))
        q_span = Span(heads.start * self.dk, key, k_heads * self.dk)
        v_span = Span(heads.start * per * self.dv, value, v_heads * self.dv)
        self.in_proj_qkvz = (Linear(cfg.hidden_size, [key, key, value, value],
                                    slot_spans=[q_span, q_span, v_span, v_span])
                             if self.qkvz_split else
                             column_parallel(cfg.hidden_size,
                                             [(2 * self.dk + 2 * per * self.dv) * k_heads],
                                             what="linear_num_key_heads"))
        self.in_proj_ba = column_parallel(cfg.hidden_size, [2 * v_heads],
                                          what="linear_num_value_heads")
        self.conv1d = nn.Module()  # the checkpoint's conv1d.weight [conv_dim, 1, K]
        self.conv1d.weight = nn.Parameter(torch.zeros(self.conv_dim, 1, self.kernel),
                                          requires_grad=False)
        self.conv1d.weight.weight_loader = lambda param, full: param.data.copy_(torch.cat([
            span.take(part, 0, "conv1d.weight") for span, part in zip(
                (q_span, q_span, v_span), full.split([q_span.full, q_span.full, v_span.full]))]))
        v_heads_span = Span(heads.start * per, self.v_heads, v_heads)
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.v_heads), requires_grad=False)
        for param in (self.dt_bias, self.A_log):
            param.weight_loader = lambda param, full: param.data.copy_(
                v_heads_span.take(full, 0, "dt_bias / A_log"))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = row_parallel(v_heads * self.dv, cfg.hidden_size,
                                     what="linear_num_value_heads x linear_value_head_dim")
        # per batch row, then per checkpoint slot: the conv window [conv_dim, K - 1]
        # (activation dtype) and the state [v_heads, d_k, d_v] (float32); set by allocate_state
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None
        self.first_checkpoint = 0  # the row of checkpoint slot 0
        # per batch row, a verified span not yet accepted (speculative decoding; allocate_state
        # sizes them for the longest span): its conv sequence [conv_dim, K - 1 + span] (the
        # window before it, then its inputs), its convolved inputs [span, conv_dim] and its
        # beta and g [span, v_heads]
        self.span_seq: torch.Tensor | None = None
        self.span_conv: torch.Tensor | None = None
        self.span_beta: torch.Tensor | None = None
        self.span_g: torch.Tensor | None = None

    def state_bytes(self, dtype: torch.dtype, rows: int, checkpoints: int = 0,
                    max_span: int = 0) -> int:
        """Bytes of this layer's states for `rows` requests, `checkpoints` saved ones, and span
        buffers for spans of up to `max_span` tokens."""
        elem = torch.empty((), dtype=dtype).element_size()
        state = self.conv_dim * (self.kernel - 1) * elem + self.v_heads * self.dk * self.dv * 4
        span = max_span * (2 * self.conv_dim * elem + 2 * self.v_heads * 4)
        return (rows + checkpoints) * state + rows * span

    def allocate_state(self, rows: int, dtype: torch.dtype, device: torch.device,
                       checkpoints: int = 0, max_span: int = 0) -> None:
        total = rows + checkpoints
        self.conv_state = torch.zeros(total, self.conv_dim, self.kernel - 1, dtype=dtype,
                                      device=device)
        self.ssm_state = torch.zeros(total, self.v_heads, self.dk, self.dv, dtype=torch.float32,
                                     device=device)
        self.first_checkpoint = rows
        if max_span:
            self.span_seq = torch.zeros(rows, self.conv_dim, self.kernel - 1 + max_span,
                                        dtype=dtype, device=device)
            self.span_conv = torch.zeros(rows, max_span, self.conv_dim, dtype=dtype,
                                         device=device)
            self.span_beta = torch.zeros(rows, max_span, self.v_heads, device=device)
            self.span_g = torch.zeros(rows, max_span, self.v_heads, device=device)

    def restore_states(self, rows: np.ndarray, slots: np.ndarray) -> None:
        """The requests at `rows` resume from the states saved in checkpoint `slots`."""
        saved = torch.from_numpy(self.first_checkpoint + slots)
        self.conv_state[rows] = self.conv_state[saved]
        self.ssm_state[rows] = self.ssm_state[saved]

    def start_fresh(self, rows: np.ndarray) -> None:
        """Empty the states at `rows`, whose requests start at this step."""
        if len(rows):
            self.conv_state[rows] = 0
            self.ssm_state[rows] = 0

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return call_opaque(self, positions, x)  # compiled graphs call it whole: it keeps states

    def empty_output(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    def eager_forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        rows = ctx.batch_rows
        if self.ssm_state is None or rows is None:
            raise RuntimeError("linear attention ran without its state (allocate_state, and the "
                               "step's batch rows)")
        self.start_fresh(rows[ctx.num_computed == 0])
        split = ctx.context_parallel
        if split is not None and split.split:  # the layer runs over every rank's rows
            every = self._mix(context_parallel.gather_rows(split, x), ctx)
            return context_parallel.own_rows(split, every)
        return self._mix(x, ctx)

    def _mix(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The step's tokens x [T, hidden] -> the layer's output, the states moved."""
        layout, rows = ctx.layout, ctx.batch_rows
        t = x.shape[0]
        qkv, z, beta, g = self._project(x)
        out = torch.empty(t, self.v_heads, self.dv, dtype=torch.float32, device=x.device)
        single = np.flatnonzero(layout.query_lens == 1)
        saves = self._saves(ctx.state_saves)
        if len(single):  # decodes: one batched step of every such request's state
            tokens = torch.from_numpy(layout.starts[single]).to(x.device)
            state_rows = torch.from_numpy(rows[single]).to(x.device)
            conv = self._conv_step(qkv.index_select(0, tokens), state_rows)
            out[tokens] = self._recurrent_step(conv, beta[tokens], g[tokens], state_rows)
            for r, pairs in saves.items():  # a boundary reached by a single token
                for _, slot_row in pairs if layout.query_lens[r] == 1 else ():
                    self.conv_state[slot_row] = self.conv_state[rows[r]]
                    self.ssm_state[slot_row] = self.ssm_state[rows[r]]
        drafts = ctx.num_drafts
        for r in np.flatnonzero(layout.query_lens > 1):  # prompt chunks, one request at a time
            span = slice(int(layout.starts[r]), int(layout.ends[r]))
            row = int(rows[r])
            conv, seq = self._conv_chunk(qkv[span], row)
            out[span], state = self._chunked_saving(conv, beta[span], g[span],
                                                    self.ssm_state[row], seq, saves.get(r, ()))
            if drafts is not None and drafts[r]:  # the state moves once the drafts are judged
                n = conv.shape[0]
                self.span_seq[row, :, :seq.shape[1]] = seq
                self.span_conv[row, :n] = conv
                self.span_beta[row, :n] = beta[span]
                self.span_g[row, :n] = g[span]
            else:
                self.conv_state[row] = seq[:, -(self.kernel - 1):]
                self.ssm_state[row] = state
        h = self.norm(out.to(x.dtype).reshape(-1, self.dv), z.reshape(-1, self.dv))
        return self.out_proj(h.reshape(t, -1))

    def _saves(self, saves: np.ndarray | None) -> dict[int, list[tuple[int, int]]]:
        """The step's state saves ([n, 3]: request, tokens into its step, slot) per request:
        (tokens, the slot's row)."""
        by_request: dict[int, list[tuple[int, int]]] = {}
        for r, tokens, slot in ([] if saves is None else saves.tolist()):
            by_request.setdefault(r, []).append((tokens, self.first_checkpoint + slot))
        return by_request

    def _chunked_saving(self, conv: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                        s: torch.Tensor, seq: torch.Tensor, saves: list[tuple[int, int]]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """_chunked, in pieces that end where the states are saved (after `tokens` of them:
        the window is seq's K - 1 columns from there)."""
        if not saves:
            return self._chunked(conv, beta, g, s)
        outs, begin = [], 0
        for end, slot_row in [*saves, (conv.shape[0], None)]:
            if end > begin:
                out, s = self._chunked(conv[begin:end], beta[begin:end], g[begin:end], s)
                outs.append(out)
            if slot_row is not None:
                self.conv_state[slot_row] = seq[:, end:end + self.kernel - 1]
                self.ssm_state[slot_row] = s
            begin = end
        return torch.cat(outs), s

    def _project(self, x: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> the convolution's input [T, conv_dim] (all q, then k, then v), z
        [T, v_heads, d_v], beta and g [T, v_heads] in float32."""
        t, per = x.shape[0], self.v_heads // self.k_heads
        if self.qkvz_split:
            qkv, z = self.in_proj_qkvz(x).split([self.conv_dim, self.v_heads * self.dv], dim=-1)
        else:
            mixed = self.in_proj_qkvz(x).view(t, self.k_heads, -1)  # grouped per key head
            q, k, v, z = mixed.split([self.dk, self.dk, per * self.dv, per * self.dv], dim=-1)
            qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        b, a = self.in_proj_ba(x).view(t, self.k_heads, 2 * per).split([per, per], dim=-1)
        beta = b.reshape(t, self.v_heads).sigmoid().float()  # in the model dtype, as trained
        g = -self.A_log.float().exp() * F.softplus(a.reshape(t, self.v_heads).float()
                                                   + self.dt_bias)
        return qkv, z.reshape(t, self.v_heads, self.dv), beta, g

    def _conv_step(self, x: torch.Tensor, state_rows: torch.Tensor) -> torch.Tensor:
        """One token per request: x [R, conv_dim] -> the convolution's output, the windows
        moved on by one."""
        window = torch.cat([self.conv_state[state_rows], x.unsqueeze(-1)], dim=-1)  # [R, C, K]
        self.conv_state[state_rows] = window[..., 1:]
        return F.silu((window * self.conv1d.weight.squeeze(1)).sum(-1))

    def accept_span(self, row: int, kept: int) -> None:
        """Move `row`'s state over the first `kept` tokens of its verified span (the last
        token before the drafts and the drafts accepted)."""
        self.conv_state[row] = self.span_seq[row, :, kept:kept + self.kernel - 1]
        _, self.ssm_state[row] = self._chunked(self.span_conv[row, :kept],
                                               self.span_beta[row, :kept],
                                               self.span_g[row, :kept], self.ssm_state[row])

    def _conv_chunk(self, x: torch.Tensor, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A request's tokens x [L, conv_dim] after its window -> the output [L, conv_dim], and
        the window then the tokens [conv_dim, K - 1 + L] (after n of them, the window is the
        K - 1 columns from n)."""
        seq = torch.cat([self.conv_state[row], x.t()], dim=-1)
        out = F.conv1d(seq.unsqueeze(0), self.conv1d.weight, groups=self.conv_dim)[0]
        return F.silu(out).t(), seq

    def _heads(self, conv: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The convolution's output [T, conv_dim] -> q, k [T, v_heads, d_k] (L2-normalized, q
        scaled by 1/sqrt(d_k); key heads repeated over their value heads) and v [T, v_heads,
        d_v], all float32."""
        t, key = conv.shape[0], self.k_heads * self.dk
        q, k, v = conv.float().split([key, key, self.v_heads * self.dv], dim=-1)
        per = self.v_heads // self.k_heads
        q, k = (F.normalize(y.view(t, self.k_heads, self.dk), dim=-1, eps=1e-6)
                .repeat_interleave(per, dim=1) for y in (q, k))
        return q * self.dk ** -0.5, k, v.view(t, self.v_heads, self.dv)

    def _recurrent_step(self, conv: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                        state_rows: torch.Tensor) -> torch.Tensor:
        q, k, v = self._heads(conv)  # [R, H, d]
        return fused.delta_rule_step(self.ssm_state, state_rows, q, k, v, beta, g)

    def _chunked(self, conv: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                 s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A request's prompt tokens from its state `s` -> their outputs and the state after
        them, CHUNK at a time: within a chunk, with
        gamma_t = exp(cumulative g), the updates D solve (I + M) D = beta V - (beta gamma K) S0
        with M[t, j] = beta_t (k_t . k_j) gamma_t / gamma_j below the diagonal; then
        O = gamma Q S0 + (Q K^T * gamma_t / gamma_j, j <= t) D and
        S = gamma_L S0 + (K gamma_L / gamma)^T D."""
        q, k, v = (y.transpose(0, 1) for y in self._heads(conv))  # [H, L, d]
        beta, g = beta.t(), g.t()  # [H, L]
        out = torch.empty_like(v)
        for c in range(0, q.shape[1], CHUNK):
            qc, kc, vc = q[:, c:c + CHUNK], k[:, c:c + CHUNK], v[:, c:c + CHUNK]
            bc, cum = beta[:, c:c + CHUNK], g[:, c:c + CHUNK].cumsum(-1)
            n = qc.shape[1]
            ratio = (cum.unsqueeze(-1) - cum.unsqueeze(-2))  # log gamma_t / gamma_j
            below = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            decay = torch.where(below, ratio, float("-inf")).exp()  # 0 above the diagonal
            m = (kc @ kc.transpose(-1, -2)) * decay * bc.unsqueeze(-1)
            m = m.tril(-1) + torch.eye(n, device=q.device)
            rhs = bc.unsqueeze(-1) * (vc - cum.exp().unsqueeze(-1) * (kc @ s))
            d = torch.linalg.solve_triangular(m, rhs, upper=False, unitriangular=True)
            out[:, c:c + n] = (cum.exp().unsqueeze(-1) * (qc @ s)
                               + ((qc @ kc.transpose(-1, -2)) * decay) @ d)
            last = cum[:, -1:]
            s = (last.exp().unsqueeze(-1) * s
                 + (kc * (last - cum).exp().unsqueeze(-1)).transpose(-1, -2) @ d)
        return out.transpose(0, 1), s
