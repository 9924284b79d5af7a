"""`teacher.capture: loss_mask`: samples that hold the states of the trained tokens only.

Such a sample keeps `token_ids` [T] and `loss_mask` [T] whole (a student runs its own forward pass
over the whole sequence) and holds `hidden_states` (fp8: and `hidden_scale`) for R positions only,
named by `positions` [R] int32: ascending, exactly the ones of `loss_mask`. Without `positions` a
sample holds every position (`teacher.capture: all`, the default). Receivers check that what a
sample says it holds is what it holds (`positions_problem`): the stream rejects and counts a sample
that does not (ProtocolError("positions")), a spool file that does not is a SpoolFormatError.
No torch import beyond tensors; no vLLM.
"""

from __future__ import annotations

import torch

CAPTURES = ("all", "loss_mask")  # teacher.capture's values
POSITIONS_KEY = "positions"  # int32 [R]: the token positions a sample holds states of


def positions_problem(tensors: dict[str, torch.Tensor]) -> str | None:
    """Why a sample's `positions` disagrees with what it holds (None: it agrees, or it has none).

    It must be a 1-D int32 tensor with one entry per hidden-state row (and per `hidden_scale` row),
    strictly ascending, within `token_ids`, and exactly the positions where `loss_mask` is 1."""
    pos = tensors.get(POSITIONS_KEY)
    if pos is None:
        return None
    hs, ids, lm = tensors.get("hidden_states"), tensors.get("token_ids"), tensors.get("loss_mask")
    if pos.dtype != torch.int32 or pos.dim() != 1:
        return f"positions must be [R] int32, got {list(pos.shape)} {pos.dtype}"
    if hs is None or hs.dim() < 1 or hs.shape[0] != pos.shape[0]:
        got = list(hs.shape) if hs is not None else None
        return f"{pos.shape[0]} positions for hidden_states {got} (one row per position)"
    scale = tensors.get("hidden_scale")
    if scale is not None and (scale.dim() < 1 or scale.shape[0] != pos.shape[0]):
        return f"{pos.shape[0]} positions for hidden_scale {list(scale.shape)}"
    if ids is None or ids.dim() != 1 or lm is None or lm.dim() != 1 or lm.shape[0] != ids.shape[0]:
        return "positions need token_ids [T] and loss_mask [T] beside them"
    p = pos.long()
    if p.numel() and (bool((p[1:] <= p[:-1]).any()) or int(p[0]) < 0 or int(p[-1]) >= ids.shape[0]):
        return f"positions must ascend strictly within the {ids.shape[0]} tokens"
    if not torch.equal(p, lm.nonzero().flatten()):
        return "positions are not the ones of loss_mask"
    return None


def held_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """`positions` of a sample whose loss mask is `loss_mask` [T]: its ones, as int32 [R]."""
    return loss_mask.nonzero().flatten().to(torch.int32)
