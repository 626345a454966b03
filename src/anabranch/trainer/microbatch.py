"""Micro-batches for the policy update: fixed-size in input order, or packed by a token budget.

With ``micro_batch_tokens > 0`` sequences are sorted by their real length (prompt + response tokens,
padding excluded) and packed greedily so that ``rows × padded width ≤ micro_batch_tokens`` (a single
sequence longer than the budget gets a micro-batch of its own). Each micro-batch is then cut to the
columns that hold a real token for at least one of its rows: the left prompt padding and the right
response padding that every row of the micro-batch shares are not computed at all. Sorting first
makes those shared pads large, so long and short sequences do not pad each other. When the n samples
of a prompt share its forward (``share_prefix``, models/shared_prefix.py), the budget packs whole
groups instead of rows and counts the tokens actually computed (one prompt per group).

Results are unchanged: the loss normalizers are those of the whole batch (``BatchScale``), position
ids come from the attention mask, and :meth:`MicroBatch.widen` puts per-token outputs back at their
full-width columns (zeros where cut, which the response mask excludes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MicroBatch:
    rows: torch.Tensor  # [b] indices into the step batch
    left: int           # first kept column of the [prompt | response] sequence
    right: int          # one past the last kept column
    prompt_width: int   # P of the full batch
    response_width: int  # R of the full batch

    @property
    def kept_response(self) -> int:
        """Response columns kept (the first ``kept_response`` of the R)."""
        return self.right - self.prompt_width

    def cut(self, full: torch.Tensor) -> torch.Tensor:
        """This micro-batch's rows and kept columns of a [B, P+R] tensor."""
        return full[self.rows][:, self.left:self.right]

    def widen(self, x: torch.Tensor | None) -> torch.Tensor | None:
        """[b, kept_response] -> [b, R], zero-filled on the right."""
        if x is None or self.kept_response == self.response_width:
            return x
        return torch.nn.functional.pad(x, (0, self.response_width - self.kept_response))

    def widen_hidden(self, h: torch.Tensor | None) -> torch.Tensor | None:
        """[b, right-left, H] -> [b, P+R, H], zero-filled where columns were cut."""
        if h is None:
            return None
        total = self.prompt_width + self.response_width
        return torch.nn.functional.pad(h, (0, 0, self.left, total - self.right))


def micro_batches(batch_size: int, micro: int, group_index: torch.Tensor | None = None) -> list[slice]:
    """Slices of about ``micro`` rows. With ``group_index`` (groups contiguous, as every backend
    returns them) a slice never ends inside a group, so group-level objectives (FlowRL's VarGrad)
    see whole groups; a slice then exceeds ``micro`` by less than one group."""
    groups = group_index.tolist() if group_index is not None else None
    out, start = [], 0
    while start < batch_size:
        end = min(start + micro, batch_size)
        while groups is not None and end < batch_size and groups[end] == groups[end - 1]:
            end += 1
        out.append(slice(start, end))
        start = end
    return out


def plan_micro_batches(prompt_mask: torch.Tensor, response_mask: torch.Tensor, micro_batch_size: int,
                       micro_batch_tokens: int = 0, group_index: torch.Tensor | None = None,
                       share_prefix: bool = False) -> list[MicroBatch]:
    """Split a [B, P] + [B, R] batch into micro-batches (see the module docstring).

    In the fixed-size mode, with ``group_index``, a micro-batch never ends inside a prompt's group
    (group-level objectives such as FlowRL's VarGrad need whole groups). The token-budget mode packs
    rows by length and may split groups; with ``share_prefix`` (and ``group_index``) it packs whole
    groups instead, so that each group's prompt runs once (models/shared_prefix.py), and counts
    the tokens that are then computed: one prompt per group plus every row's response. A group
    over the budget on its own is split into row chunks that each share the prompt."""
    batch, width_p = prompt_mask.shape
    width_r = response_mask.shape[1]
    if micro_batch_tokens <= 0:
        return [MicroBatch(torch.arange(s.start, s.stop), 0, width_p + width_r, width_p, width_r)
                for s in micro_batches(batch, micro_batch_size, group_index)]
    p_len = prompt_mask.sum(-1)
    r_len = response_mask.sum(-1)
    if share_prefix and group_index is not None:
        packs = _pack_groups(p_len.tolist(), r_len.tolist(), group_index.tolist(), micro_batch_tokens)
    else:
        packs = _pack_rows(p_len, r_len, micro_batch_tokens)
    out = []
    for g in packs:
        rows = torch.tensor(sorted(g))
        # At least one response column, so every row predicts something (masked when empty).
        keep_p = int(p_len[rows].max())
        keep_r = max(int(r_len[rows].max()), 1)
        out.append(MicroBatch(rows, width_p - keep_p, width_p + keep_r, width_p, width_r))
    return out


def _pack_rows(p_len: torch.Tensor, r_len: torch.Tensor, budget: int) -> list[list[int]]:
    """Rows longest first, greedily, while rows × (longest prompt + longest response) fits."""
    order = torch.argsort(p_len + r_len, descending=True, stable=True)
    packs, current, cur_p, cur_r = [], [], 0, 0
    for i in order.tolist():
        p, r = int(p_len[i]), int(r_len[i])
        new_p, new_r = max(cur_p, p), max(cur_r, r)
        if current and (len(current) + 1) * (new_p + new_r) > budget:
            packs.append(current)
            current, new_p, new_r = [], p, r
        current.append(i)
        cur_p, cur_r = new_p, new_r
    if current:
        packs.append(current)
    return packs


def _pack_groups(p_len: list[int], r_len: list[int], group_index: list[int], budget: int) -> list[list[int]]:
    """Whole groups (runs of equal ``group_index``) longest first, greedily, while
    groups × longest prompt + rows × longest response fits the budget."""
    units: list[list[int]] = []
    for i, g in enumerate(group_index):
        if units and group_index[units[-1][-1]] == g:
            units[-1].append(i)
        else:
            units.append([i])
    # A group too long for the budget alone: chunks of rows that fit (each chunk shares its prompt).
    split = []
    for u in units:
        p, r = max(p_len[i] for i in u), max(max(r_len[i] for i in u), 1)
        k = max((budget - p) // r, 1)
        split.extend(u[s:s + k] for s in range(0, len(u), k))
    split.sort(key=lambda u: -max(p_len[i] + r_len[i] for i in u))  # stable: ties keep input order
    packs, current, n_units, cur_p, cur_r = [], [], 0, 0, 0
    for u in split:
        p, r = max(p_len[i] for i in u), max(r_len[i] for i in u)
        new_p, new_r = max(cur_p, p), max(cur_r, r)
        if current and (n_units + 1) * new_p + (len(current) + len(u)) * new_r > budget:
            packs.append(current)
            current, n_units, new_p, new_r = [], 0, p, r
        current.extend(u)
        n_units += 1
        cur_p, cur_r = new_p, new_r
    if current:
        packs.append(current)
    return packs


def forward_micro_batch(model, mb: MicroBatch, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        temperature: float, **kwargs):
    """:func:`response_forward` on the micro-batch's kept columns, outputs put back at full width
    (``share_prefix=True`` in ``kwargs``: rows with the same prompt run it once)."""
    from anabranch.models.logprobs import ForwardOut, response_forward

    rows = mb.rows.to(input_ids.device)
    ids = input_ids[rows][:, mb.left:mb.right]
    mask = attention_mask[rows][:, mb.left:mb.right]
    fo = response_forward(model, ids, mask, mb.kept_response, temperature, **kwargs)
    return ForwardOut(log_probs=mb.widen(fo.log_probs), entropy=mb.widen(fo.entropy),
                      hidden=mb.widen_hidden(fo.hidden))
