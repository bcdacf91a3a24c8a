"""Forward replacements that put transformers' experts on the export paths users actually get.

Both compute every token through every expert with batched GEMMs and then zero out the unselected
experts with dense routing weights: the form that accelerator exporters produce (optimum for GPT-OSS on
transformers 4.5x, optimum-intel for transformers 5 MoE models going to OpenVINO).
"""

from __future__ import annotations

import contextlib

import torch

TILED_EXPERTS_IMPLEMENTATION = "tiled_bmm"


def gpt_oss_tiled_experts_forward(self, hidden_states, router_indices=None, routing_weights=None):
    """transformers 4.57 GptOssExperts, always on its non-CPU inference branch.

    `routing_weights` is the router's dense [T, E] score matrix (zeros for unselected experts).
    """
    batch_size = hidden_states.shape[0]
    num_experts = routing_weights.shape[1]
    tokens = hidden_states.reshape(-1, self.hidden_size)
    tiled = tokens.repeat(num_experts, 1).view(num_experts, -1, self.hidden_size)
    gate_up = torch.bmm(tiled, self.gate_up_proj) + self.gate_up_proj_bias[..., None, :]
    gate = gate_up[..., ::2].clamp(max=self.limit)
    up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
    activated = (up + 1) * gate * torch.sigmoid(gate * self.alpha)
    expert_out = torch.bmm(activated, self.down_proj) + self.down_proj_bias[..., None, :]
    expert_out = expert_out.view(num_experts, batch_size, -1, self.hidden_size)
    weights = routing_weights.transpose(0, 1).view(num_experts, batch_size, -1)[..., None]
    return (expert_out * weights).sum(dim=0)


def tiled_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """A transformers 5 experts implementation: tile tokens over all experts, bmm, weight, sum.

    Registered under TILED_EXPERTS_IMPLEMENTATION. Weights are used as [E, in, out] (transposed from
    the stored [E, out, in] unless the class stores them transposed already), no squeeze/unsqueeze
    around the GEMMs, and the top-k weights are scattered into a dense [T, E] matrix.
    """
    num_tokens, hidden_dim = hidden_states.shape
    num_experts = self.gate_up_proj.shape[0]
    gate_up_weight = self.gate_up_proj if self.is_transposed else self.gate_up_proj.transpose(1, 2)
    down_weight = self.down_proj if self.is_transposed else self.down_proj.transpose(1, 2)

    dense_weights = torch.zeros(num_tokens, num_experts, dtype=hidden_states.dtype, device=hidden_states.device)
    dense_weights = dense_weights.scatter(1, top_k_index, top_k_weights.to(hidden_states.dtype))

    tiled = hidden_states.repeat(num_experts, 1).view(num_experts, num_tokens, hidden_dim)
    gate_up = torch.bmm(tiled, gate_up_weight)
    if self.has_bias:
        gate_up = gate_up + self.gate_up_proj_bias[:, None, :]
    activated = self._apply_gate(gate_up)
    expert_out = torch.bmm(activated, down_weight)
    if self.has_bias:
        expert_out = expert_out + self.down_proj_bias[:, None, :]
    return (expert_out * dense_weights.transpose(0, 1)[..., None]).sum(dim=0)


def register_tiled_experts() -> None:
    """Make TILED_EXPERTS_IMPLEMENTATION selectable through a transformers 5 config."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(TILED_EXPERTS_IMPLEMENTATION, tiled_experts_forward)


def sdpa_mask_by_broadcasting(
    batch_size, cache_position, kv_length, kv_offset=0, mask_function=None, attention_mask=None, **_
):
    """transformers 4.57 `sdpa_mask` computed by broadcasting index tensors instead of torch.vmap.

    The mask functions are elementwise in (batch, head, q, kv) index tensors, so calling them once on
    broadcastable aranges gives the [B, 1, Q, KV] boolean mask that vmap builds point by point.
    """
    from transformers import masking_utils

    mask_function = mask_function or masking_utils.causal_mask_function
    padding_mask = masking_utils.prepare_padding_mask(attention_mask, kv_length, kv_offset)
    device = cache_position.device
    batch = torch.arange(batch_size, device=device)[:, None, None, None]
    head = torch.zeros(1, dtype=torch.long, device=device)[None, :, None, None]
    query = cache_position[None, None, :, None]
    key = (torch.arange(kv_length, device=device) + kv_offset)[None, None, None, :]
    mask = mask_function(batch, head, query, key).expand(batch_size, 1, cache_position.shape[0], kv_length)
    if padding_mask is not None:
        mask = mask & padding_mask[:, None, None, :].bool()
    return mask


@contextlib.contextmanager
def masks_without_vmap():
    """transformers 4.57 attention masks built without torch.vmap, which the TorchScript exporter cannot trace.

    Under tracing, 4.57 builds causal masks with torch.vmap (both its `sdpa_mask` versions); the traced
    graph then has the trace's sequence length baked in. Exporters for TorchScript (optimum) swap in a
    vmap-free mask the same way. transformers 5 builds masks without vmap already: nothing to patch.
    """
    from transformers import masking_utils

    if not hasattr(masking_utils, "sdpa_mask_older_torch"):
        yield
        return
    original = masking_utils.sdpa_mask
    masking_utils.sdpa_mask = sdpa_mask_by_broadcasting
    try:
        yield
    finally:
        masking_utils.sdpa_mask = original
