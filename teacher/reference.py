"""transformers' hidden states under the teacher's layer-id convention (the one vLLM extraction
uses): id 0 = embeddings, k = `hidden_states[k]` (output of decoder layer k-1), L =
num_hidden_layers = the last decoder layer's output BEFORE the final norm (transformers'
`hidden_states[L]` is after it). Used by the live probe (teacher/verify.py) and the synthetic
teacher (testkit/synthetic_teacher.py)."""

from __future__ import annotations

import torch


def decoder_layers(model):
    """The decoder layer list of a causal LM (plain, multimodal or GPT-2 layout)."""
    for path in ("model.layers", "model.language_model.layers", "transformer.h"):
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
            return obj
        except AttributeError:
            continue
    return model.get_decoder().layers


class ReferenceStates:
    """Wraps a loaded transformers model; `states(input_ids, layer_ids)` -> [T, n, H]."""

    def __init__(self, model):
        self.model = model
        layers = decoder_layers(model)
        self.num_layers = len(layers)
        self._last: dict[str, torch.Tensor] = {}
        layers[-1].register_forward_hook(self._hook)  # its output = id L, before the final norm

    def _hook(self, _mod, _inp, out) -> None:
        self._last["h"] = out[0] if isinstance(out, tuple) else out

    def states(self, input_ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
        """[T, len(layer_ids), H] of one sequence (`input_ids` [1, T], on the model's device)."""
        with torch.no_grad():
            out = self.model(input_ids=input_ids, output_hidden_states=True)
        cols = [self._last["h"][0] if k == self.num_layers else out.hidden_states[k][0] for k in layer_ids]
        return torch.stack(cols, dim=1)
