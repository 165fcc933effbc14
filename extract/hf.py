"""The transformers backend: any AutoModelForCausalLM target, aux states captured with forward hooks.

Only the configured layers' outputs are kept (hooks, not `output_hidden_states`, which holds every layer),
and the decoder is called without the LM head, so no [T, vocab] logits are computed. The final hidden
state is the decoder's `last_hidden_state`: **after** the target's final norm ("post_norm"), which is
also what SGLang returns; the trainer's teacher then applies only the LM head.
"""
from __future__ import annotations

import torch

FINAL_HIDDEN = "post_norm"


class AuxCapture:
    """Forward hooks on the decoder layers named by SGLang-convention ids (id i = output of layer i); `take()`
    returns the captured outputs concatenated [..., n_aux * H]. Extraction and the reference decoder share it."""

    def __init__(self, layers, aux_layer_ids: list[int]):
        self.aux_layer_ids = aux_layer_ids
        self._captured: dict[int, torch.Tensor] = {}
        for i in aux_layer_ids:
            layers[i].register_forward_hook(self._hook(i))

    def _hook(self, layer_id: int):
        def hook(_module, _inputs, output):
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output
        return hook

    def take(self) -> torch.Tensor:
        aux = torch.cat([self._captured[i] for i in self.aux_layer_ids], dim=-1)
        self._captured.clear()
        return aux


class HFBackend:
    def __init__(self, target_path: str, aux_layer_ids: list[int], dtype: torch.dtype, device: torch.device,
                 trust_remote_code: bool = False):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(target_path, dtype=dtype, trust_remote_code=trust_remote_code)
        self.decoder = model.get_decoder().to(device).eval()
        del model  # drops the LM head; the decoder keeps its own modules
        self.device, self.aux_layer_ids = device, aux_layer_ids
        self.aux = AuxCapture(self.decoder.layers, aux_layer_ids)

    @torch.inference_mode()
    def capture(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, T] right-padded batch → aux [N, n_aux * H], final [N, H] on the device: each row's real tokens,
        row after row (N = attention_mask.sum()), the packed layout SGLang returns and the shards store."""
        mask = attention_mask.to(self.device)
        out = self.decoder(input_ids=input_ids.to(self.device), attention_mask=mask, use_cache=False)
        aux, final = self.aux.take(), out.last_hidden_state
        if bool(attention_mask.all()):  # no padding: packing is a view
            return aux.flatten(0, 1), final.flatten(0, 1)
        valid = mask.bool()
        return aux[valid], final[valid]
